// Greedy tokens from llama.cpp's CPU build (npm node-llama-cpp) for
// test_llamacpp: node llamacpp_greedy.mjs MODULE_DIR MODEL.gguf N TOKEN...
// Prints the N generated token ids on one line.
const [module_dir, model_path, n_s, ...prompt_s] = process.argv.slice(2);
const {getLlama} = await import(module_dir + "/node_modules/node-llama-cpp/dist/index.js");
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: model_path});
const ctx = await model.createContext({contextSize: 256, threads: 2, sequences: 1});
const seq = ctx.getSequence();
const out = [];
for await (const tok of seq.evaluate(prompt_s.map(Number), {temperature: 0})) {
    out.push(tok);
    if (out.length >= parseInt(n_s)) break;
}
console.log(out.join(" "));
await ctx.dispose(); await model.dispose(); await llama.dispose();
