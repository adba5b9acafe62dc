// Validates kvd's constrained outputs with Ajv (JSON Schema 2020-12, with
// ajv-formats), for test_schema_output: node ajv_validate.mjs MODULE_DIR FILE
// FILE holds one JSON object a line: {"schema": ..., "text": "..."}. Prints
// "valid N" when every text parses as JSON and validates against its schema;
// otherwise each failure and exits 1.
import {readFileSync} from "node:fs";
const [module_dir, file] = process.argv.slice(2);
const {default: Ajv2020} = await import(module_dir + "/node_modules/ajv/dist/2020.js");
const {default: addFormats} = await import(module_dir + "/node_modules/ajv-formats/dist/index.js");
const ajv = new Ajv2020({strict: false, allErrors: true});
addFormats(ajv);
let n = 0, bad = 0;
for (const line of readFileSync(file, "utf8").split("\n")) {
    if (!line) continue;
    const {schema, text} = JSON.parse(line);
    n++;
    let value;
    try {
        value = JSON.parse(text);
    } catch (e) {
        bad++;
        console.log(`not JSON (${e.message}): ${JSON.stringify(text)} schema ${JSON.stringify(schema)}`);
        continue;
    }
    const validate = ajv.compile(schema);
    if (!validate(value)) {
        bad++;
        console.log(`invalid ${JSON.stringify(validate.errors)}: ${JSON.stringify(text)} schema ${JSON.stringify(schema)}`);
    }
}
console.log(bad ? `${bad} of ${n} invalid` : `valid ${n}`);
process.exit(bad ? 1 : 0);
