// llama.cpp's tokenizer (npm node-llama-cpp) for test_tokenizer_llamacpp and
// bench_tokenizer:
//   node tokenizer_llamacpp.mjs MODULE_DIR compare MODEL TEXTS IDSEQS OUT [MODEL TEXTS IDSEQS OUT]...
//     TEXTS: one JSON string a line; writes to OUT one JSON array a line:
//     [tokenize(t, false), tokenize(t, true), detokenize(ids0, false), detokenize(ids1, true)];
//     then for each line of IDSEQS (a JSON array of ids):
//     [detokenize(ids, false), detokenize(ids, true)]
//   node tokenizer_llamacpp.mjs MODULE_DIR bench MODEL TEXT_FILE REPEATS
//     prints "tokens seconds" for the best of REPEATS tokenizations of the file.
// The model's own tokenize/detokenize (the addon's, i.e. llama_tokenize with
// add_special false, and llama_detokenize with remove_special false).
import {readFileSync, writeFileSync} from "node:fs";
const [module_dir, mode, ...rest] = process.argv.slice(2);
const {getLlama} = await import(module_dir + "/node_modules/node-llama-cpp/dist/index.js");
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const lines = (p) => readFileSync(p, "utf8").split("\n").filter((l) => l.length > 0);
if (mode === "compare") {
    for (let i = 0; i + 3 < rest.length; i += 4) {
        const [model_path, texts, idseqs, out] = rest.slice(i, i + 4);
        const model = await llama.loadModel({modelPath: model_path, vocabOnly: true});
        const m = model._model;
        const res = [];
        for (const l of lines(texts)) {
            const t = JSON.parse(l);
            const a = t === "" ? new Uint32Array() : m.tokenize(t, false);
            const b = t === "" ? new Uint32Array() : m.tokenize(t, true);
            res.push(JSON.stringify([Array.from(a), Array.from(b), m.detokenize(a, false),
                                     m.detokenize(b, true)]));
        }
        for (const l of lines(idseqs)) {
            const ids = Uint32Array.from(JSON.parse(l));
            res.push(JSON.stringify([m.detokenize(ids, false), m.detokenize(ids, true)]));
        }
        writeFileSync(out, res.join("\n") + "\n");
        await model.dispose();
    }
} else if (mode === "bench") {
    const [model_path, text_file, reps] = rest;
    const model = await llama.loadModel({modelPath: model_path, vocabOnly: true});
    const text = readFileSync(text_file, "utf8");
    let best = Infinity, n = 0;
    for (let r = 0; r < parseInt(reps); r++) {
        const t0 = process.hrtime.bigint();
        n = model._model.tokenize(text, false).length;
        const dt = Number(process.hrtime.bigint() - t0) / 1e9;
        if (dt < best) best = dt;
    }
    console.log(n + " " + best);
    await model.dispose();
}
await llama.dispose();
