/* two_models: the two small models of the several-models tests (see
 * two_models.h). */
#include "two_models.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int two_models_make(const char *tmpl, char *dir, char *a, char *b)
{
    const char *tools = getenv("KVD_TOOLS_DIR");
    char cmd[1024];
    snprintf(dir, 64, "%s", tmpl);
    if (!tools || !mkdtemp(dir))
        return -1;
    snprintf(a, 128, "%s/a.gguf", dir);
    snprintf(b, 128, "%s/b.gguf", dir);
    snprintf(cmd, sizeof cmd,
             "%s/kvd-gguf-gen -o %s --arch llama --layers 2 --embd 128 --heads 4 --kv-heads 2 "
             "--ff 256 --vocab 500 --ctx 256 --type f32 --seed 3 >/dev/null && "
             "%s/kvd-gguf-gen -o %s --arch qwen2 --layers 3 --embd 192 --heads 6 --kv-heads 3 "
             "--ff 384 --vocab 700 --ctx 256 --type f16 --seed 4 >/dev/null",
             tools, a, tools, b);
    return system(cmd) == 0 ? 0 : -1;
}

void two_models_remove(const char *dir, const char *a, const char *b)
{
    unlink(a);
    unlink(b);
    rmdir(dir);
}
