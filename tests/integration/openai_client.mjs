// The official `openai` npm client against kvd's HTTP API, for
// test_http_openai: node openai_client.mjs MODULE_DIR BASE_URL API_KEY
// Runs a completion and a chat, each non-streamed and streamed, at
// temperature 0, and prints their texts, token ids (kvd's "tokens" field)
// and usage as one JSON object; then n = 3 choices (non-streamed and
// streamed) and response_format (json_schema, json_object) answers.
const [module_dir, base_url, api_key] = process.argv.slice(2);
const {default: OpenAI} = await import(module_dir + "/node_modules/openai/index.mjs");
const client = new OpenAI({baseURL: base_url, apiKey: api_key, maxRetries: 0, timeout: 60000});
const prompt = "Once upon a time";
const messages = [{role: "user", content: "Tell me a story."}];
const out = {};

const c = await client.completions.create({model: "kvd", prompt, max_tokens: 12, temperature: 0});
out.completion = {text: c.choices[0].text, tokens: c.choices[0].tokens,
                  finish: c.choices[0].finish_reason, usage: c.usage};

let text = "", tokens = [], usage = null, finish = null;
const cs = await client.completions.create({model: "kvd", prompt, max_tokens: 12, temperature: 0,
                                            stream: true, stream_options: {include_usage: true}});
for await (const ch of cs) {
    if (ch.usage) usage = ch.usage;
    for (const choice of ch.choices) {
        text += choice.text ?? "";
        tokens.push(...(choice.tokens ?? []));
        if (choice.finish_reason) finish = choice.finish_reason;
    }
}
out.completion_stream = {text, tokens, finish, usage};

const k = await client.chat.completions.create({model: "kvd", messages, max_tokens: 10,
                                                temperature: 0});
out.chat = {text: k.choices[0].message.content, tokens: k.choices[0].message.tokens,
            role: k.choices[0].message.role, finish: k.choices[0].finish_reason, usage: k.usage};

text = ""; tokens = []; usage = null; finish = null;
let role = null;
const ks = await client.chat.completions.create({model: "kvd", messages, max_tokens: 10,
                                                 temperature: 0, stream: true,
                                                 stream_options: {include_usage: true}});
for await (const ch of ks) {
    if (ch.usage) usage = ch.usage;
    for (const choice of ch.choices) {
        if (choice.delta.role) role = choice.delta.role;
        text += choice.delta.content ?? "";
        tokens.push(...(choice.delta.tokens ?? []));
        if (choice.finish_reason) finish = choice.finish_reason;
    }
}
out.chat_stream = {text, tokens, role, finish, usage};

// n > 1: choices[i].index, non-streamed and streamed (chunks interleave)
const cn = await client.completions.create({model: "kvd", prompt, max_tokens: 8, temperature: 1,
                                            seed: 42, n: 3});
out.completion_n = cn.choices.map((c) => ({index: c.index, tokens: c.tokens}));
out.completion_n_usage = cn.usage;
const sn = await client.completions.create({model: "kvd", prompt, max_tokens: 8, temperature: 1,
                                            seed: 42, n: 3, stream: true});
const per = [[], [], []];
for await (const ch of sn)
    for (const choice of ch.choices) per[choice.index].push(...(choice.tokens ?? []));
out.completion_n_stream = per;

// response_format: a JSON Schema, and any JSON object
const person = {type: "object", properties: {name: {type: "string", maxLength: 8},
                age: {type: "integer", minimum: 0, maximum: 99}},
                required: ["name", "age"], additionalProperties: false};
const js = await client.chat.completions.create({
    model: "kvd", messages, max_tokens: 300, temperature: 1, seed: 7,
    response_format: {type: "json_schema", json_schema: {name: "person", strict: true, schema: person}}});
out.json_schema = JSON.parse(js.choices[0].message.content);
const jo = await client.chat.completions.create({
    model: "kvd", messages, max_tokens: 300, temperature: 1, seed: 8,
    logit_bias: {"37": 4, "128": 4, "96": 4}, response_format: {type: "json_object"}});
out.json_object = JSON.parse(jo.choices[0].message.content);

const models = await client.models.list();
out.models = models.data.map((m) => m.id);

// An error comes back as the client's APIError with the HTTP status.
try {
    await client.completions.create({model: "kvd", prompt, max_tokens: "many"});
    out.error_status = 0;
} catch (e) {
    out.error_status = e.status;
}
console.log(JSON.stringify(out));
