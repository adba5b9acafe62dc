// Decode throughput of llama.cpp's CPU build (npm node-llama-cpp, installed by
// tests/bench/vs_llamacpp.sh) on a GGUF file, for side-by-side comparison with
// kvd's bench_forward. Usage:
//   node llamacpp_decode.mjs MODULE_DIR MODEL.gguf THREADS PROMPT_LEN GEN_LEN
// MODULE_DIR holds node_modules/node-llama-cpp. Prints one JSON line:
// {"threads","prompt","gen","prefill_tok_s","decode_tok_s","decode_cpu_ms_per_tok","tokens"};
// decode_cpu_ms_per_tok is process CPU time (getrusage, all threads) per
// decoded token, which other load on a shared machine does not inflate much.
const [module_dir, model_path, threads_s, prompt_s, gen_s] = process.argv.slice(2);
const {getLlama} = await import(module_dir + "/node_modules/node-llama-cpp/dist/index.js");
const threads = parseInt(threads_s || "2"), prompt_len = parseInt(prompt_s || "16"),
      gen_len = parseInt(gen_s || "64");
const llama = await getLlama({gpu: false, build: "never", maxThreads: threads, logLevel: "error"});
const model = await llama.loadModel({modelPath: model_path});
const ctx = await model.createContext({contextSize: 2048, threads: {ideal: threads, min: threads},
                                      batchSize: 512, sequences: 1});
const seq = ctx.getSequence();
// Same prompt rule as kvd's bench_forward: 1 + (i * 7919) % (vocab - 1), vocab 32000.
const prompt = Array.from({length: prompt_len}, (_, i) => 1 + ((i * 7919) % 31999));
const cpu_us = () => { const u = process.cpuUsage(); return u.user + u.system; };
const t0 = performance.now();
let t_first = 0, c_first = 0;
const out = [];
for await (const tok of seq.evaluate(prompt, {temperature: 0})) {
    if (out.length === 0) { t_first = performance.now(); c_first = cpu_us(); }
    out.push(tok);
    if (out.length >= gen_len) break;
}
const t1 = performance.now(), c1 = cpu_us();
console.log(JSON.stringify({threads, prompt: prompt_len, gen: out.length,
    prefill_tok_s: prompt_len / ((t_first - t0) / 1000),
    decode_tok_s: (out.length - 1) / ((t1 - t_first) / 1000),
    decode_cpu_ms_per_tok: (c1 - c_first) / 1000 / (out.length - 1), tokens: out}));
await ctx.dispose(); await model.dispose(); await llama.dispose();
