// llama.cpp's next-token distribution (npm node-llama-cpp, CPU build) at
// given positions, for test_logprobs_llamacpp:
//   node llamacpp_logprobs.mjs MODULE_DIR MODEL.gguf N_PROMPT N_TOP TOKEN...
// evaluates the TOKENs (the prompt's N_PROMPT, then a completion) and, for
// each position from N_PROMPT - 1 to the second last, prints one line: the
// log-probability of the token that follows it there, then the N_TOP most
// likely tokens as id:logprob, most likely first. node-llama-cpp gives no
// logits, but its `probabilities` (controlledEvaluate, greedy sampler: no
// stage changes the row) are llama.cpp's raw logits' softmax over the whole
// vocabulary in float (expf of logit - max, divided by the float sum), so
// log(p) is their log-softmax to float rounding (~1e-6). With
// $KVD_LLCPP_BATCH, that batch size (1: a token per batch, so every row
// takes llama.cpp's one-row path). A last line names the cpu library
// llama.cpp loaded.
const [module_dir, model_path, n_prompt_s, n_top_s, ...tokens_s] = process.argv.slice(2);
const {getLlama} = await import(module_dir + "/node_modules/node-llama-cpp/dist/index.js");
const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: model_path});
const batch = process.env.KVD_LLCPP_BATCH ? parseInt(process.env.KVD_LLCPP_BATCH) : undefined;
// With $KVD_LLCPP_F32_KV: an f32 KV cache and no flash attention (its cpu
// flash attention rounds q and the V sums to f16): attention in f32.
const f32 = process.env.KVD_LLCPP_F32_KV
    ? {flashAttention: false, experimentalKvCacheKeyType: "F32", experimentalKvCacheValueType: "F32"}
    : {};
const ctx = await model.createContext({contextSize: 256, threads: 2, sequences: 1, batchSize: batch, ...f32});
const seq = ctx.getSequence();
const toks = tokens_s.map(Number), n_prompt = parseInt(n_prompt_s), n_top = parseInt(n_top_s);
const input = toks.map((t, i) =>
    i >= n_prompt - 1 && i + 1 < toks.length ? [t, {generateNext: {probabilities: true}}] : t);
const res = await seq.controlledEvaluate(input);
const lines = [];
for (let i = n_prompt - 1; i + 1 < toks.length; i++) {
    const probs = res[i].next.probabilities; // sorted, most likely first
    const p = probs.get(toks[i + 1]);
    const fields = [p > 0 ? Math.log(p) : "-inf"];
    for (const [id, q] of probs) {
        if (fields.length > n_top) break;
        fields.push(id + ":" + (q > 0 ? Math.log(q) : "-inf"));
    }
    lines.push(fields.join(" "));
}
console.log(lines.join("\n"));
const fs = await import("fs");
const libs = fs.readFileSync("/proc/self/maps", "utf8").match(/libggml-cpu-[\w-]+\.so/g);
console.log("cpu: " + (libs ? libs[0] : "unknown"));
await ctx.dispose(); await model.dispose(); await llama.dispose();
