// Greedy tokens from llama.cpp's CPU build (npm node-llama-cpp) for
// test_llamacpp: node llamacpp_greedy.mjs MODULE_DIR MODEL.gguf N TOKEN...
// Prints the N generated token ids on one line. With $KVD_LLCPP_SAMPLER, a
// JSON {penalty, frequency, presence, last_n, bias: [[id, logit], ...]}:
// llama.cpp's logit bias and penalties sampler (window: the last last_n
// tokens of the prompt and the completion) before the greedy pick. With
// $KVD_LLCPP_GRAMMAR, a GBNF grammar (see below). With
// $KVD_LLCPP_BATCH, that batch size (1: the prompt a token per batch, so
// every row takes llama.cpp's one-row path). A second line names the cpu
// library llama.cpp loaded.
const [module_dir, model_path, n_s, ...prompt_s] = process.argv.slice(2);
const {getLlama} = await import(module_dir + "/node_modules/node-llama-cpp/dist/index.js");
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: model_path});
const batch = process.env.KVD_LLCPP_BATCH ? parseInt(process.env.KVD_LLCPP_BATCH) : undefined;
const ctx = await model.createContext({contextSize: 256, threads: 2, sequences: 1, batchSize: batch});
const seq = ctx.getSequence();
const out = [];
const prompt = prompt_s.map(Number);
const opts = {temperature: 0};
if (process.env.KVD_LLCPP_SAMPLER) {
    const sp = JSON.parse(process.env.KVD_LLCPP_SAMPLER);
    const {TokenBias} = await import(module_dir + "/node_modules/node-llama-cpp/dist/index.js");
    opts.repeatPenalty = {
        punishTokens: () => prompt.concat(out).slice(-sp.last_n),
        maxPunishTokens: sp.last_n,
        penalty: sp.penalty,
        frequencyPenalty: sp.frequency,
        presencePenalty: sp.presence,
    };
    if (sp.bias && sp.bias.length) {
        const tb = new TokenBias(model.tokenizer);
        for (const [id, b] of sp.bias)
            tb.set(id, b === null ? "never" : {logit: b});
        opts.tokenBias = tb;
    }
}
// With $KVD_LLCPP_GRAMMAR (GBNF text): llama.cpp's grammar sampler before
// the greedy pick; generation stops at an end-of-generation token (not printed).
if (process.env.KVD_LLCPP_GRAMMAR) {
    const {LlamaGrammarEvaluationState} = await import(module_dir + "/node_modules/node-llama-cpp/dist/index.js");
    const grammar = await llama.createGrammar({grammar: process.env.KVD_LLCPP_GRAMMAR});
    opts.grammarEvaluationState = new LlamaGrammarEvaluationState({model, grammar});
}
for await (const tok of seq.evaluate(prompt, opts)) {
    if (process.env.KVD_LLCPP_GRAMMAR && model.isEogToken(tok)) break; // the end, not compared
    out.push(tok);
    if (out.length >= parseInt(n_s)) break;
}
console.log(out.join(" "));
const fs = await import("fs");
const libs = fs.readFileSync("/proc/self/maps", "utf8").match(/libggml-cpu-[\w-]+\.so/g);
console.log("cpu: " + (libs ? libs[0] : "unknown"));
await ctx.dispose(); await model.dispose(); await llama.dispose();
