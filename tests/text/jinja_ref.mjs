// Renders chat templates with @huggingface/jinja (the renderer node-llama-cpp
// uses), for test_chat_template_ref: one process for every case.
//   node jinja_ref.mjs JINJA_DIR CASES.json
// CASES.json: {"templates": [source...], "cases": [{"t": index, "m": [[role,
// content]...], "g": add_generation_prompt, "bos": "...", "eos": "..."}]};
// a case with "ctx" ({messages: [objects], tools}) renders those instead of
// "m" (conversations with tool calls).
// Output per case: "OK <bytes>\n<text>" or "ERR <bytes>\n<message>", lengths
// in UTF-8 bytes. KVD_FIXED_NOW (seconds) fixes the clock strftime_now reads.
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [dir, casesPath] = process.argv.slice(2);
const fixed = process.env.KVD_FIXED_NOW;
if (fixed) {
	const RealDate = Date;
	globalThis.Date = class extends RealDate {
		constructor(...args) {
			super(...(args.length ? args : [Number(fixed) * 1000]));
		}
	};
}
const { Template } = await import(pathToFileURL(`${dir}/dist/index.js`).href);
const input = JSON.parse(readFileSync(casesPath, "utf8"));
const compiled = input.templates.map((src) => {
	try {
		return new Template(src);
	} catch (e) {
		return e;
	}
});
const chunks = [];
for (const c of input.cases) {
	let tag, text;
	const t = compiled[c.t];
	try {
		if (t instanceof Error) throw t;
		const vars = c.ctx
			? { ...c.ctx }
			: { messages: c.m.map(([role, content]) => ({ role, content })) };
		vars.add_generation_prompt = c.g;
		vars.bos_token = c.bos;
		vars.eos_token = c.eos;
		text = t.render(vars);
		tag = "OK";
	} catch (e) {
		tag = "ERR";
		text = String(e && e.message !== undefined ? e.message : e);
	}
	const body = Buffer.from(text, "utf8");
	chunks.push(Buffer.from(`${tag} ${body.length}\n`, "utf8"), body);
}
process.stdout.write(Buffer.concat(chunks));
