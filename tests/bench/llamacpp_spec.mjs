// llama.cpp's own speculative decoding (npm node-llama-cpp's token
// predictors: InputLookupTokenPredictor = prompt lookup, and
// DraftSequenceTokenPredictor = a draft model) on the same GGUF files and
// prompt tokens as kvd's bench_spec, for side-by-side figures. Usage:
//   node llamacpp_spec.mjs MODULE_DIR TARGET.gguf DRAFT.gguf THREADS PROMPT.json GEN MODE
// MODE: off | lookup | draft. PROMPT.json: an array of token ids. Prints one
// JSON line: {"mode","gen","decode_tok_s","validated","refuted","tokens"}.
const [module_dir, target, draft, threads_s, prompt_file, gen_s, mode] = process.argv.slice(2);
const {getLlama, InputLookupTokenPredictor, DraftSequenceTokenPredictor} =
    await import(module_dir + "/node_modules/node-llama-cpp/dist/index.js");
const fs = await import("node:fs");
const threads = parseInt(threads_s || "2"), gen = parseInt(gen_s || "96");
const prompt = JSON.parse(fs.readFileSync(prompt_file, "utf8"));
const llama = await getLlama({gpu: false, build: "never", maxThreads: threads, logLevel: "error"});
const model = await llama.loadModel({modelPath: target});
const ctx = await model.createContext({contextSize: 2048, threads: {ideal: threads, min: threads},
                                      batchSize: 512, sequences: 1});
let dmodel = null, dctx = null, predictor;
if (mode === "lookup") {
    // kvd's defaults: suffixes of 1..3 tokens, up to 8 drafts
    predictor = new InputLookupTokenPredictor({patternLength: {min: 1, max: 3},
                                               predictionLength: {min: 1, max: 8}});
} else if (mode === "draft") {
    dmodel = await llama.loadModel({modelPath: draft});
    dctx = await dmodel.createContext({contextSize: 2048,
                                       threads: {ideal: threads, min: threads}, sequences: 1});
    predictor = new DraftSequenceTokenPredictor(dctx.getSequence(), {minTokens: 0});
}
const seq = ctx.getSequence(predictor ? {tokenPredictor: predictor} : undefined);
const t0 = performance.now();
let t_first = 0;
const out = [];
for await (const tok of seq.evaluate(prompt, {temperature: 0})) {
    if (out.length === 0) t_first = performance.now();
    out.push(tok);
    if (out.length >= gen) break;
}
const t1 = performance.now();
const st = seq.tokenPredictions;
console.log(JSON.stringify({mode, gen: out.length, prefill_ms: t_first - t0,
    decode_tok_s: (out.length - 1) / ((t1 - t_first) / 1000),
    validated: st.validated, refuted: st.refuted, tokens: out}));
await ctx.dispose(); await model.dispose();
if (dctx) await dctx.dispose();
if (dmodel) await dmodel.dispose();
await llama.dispose();
