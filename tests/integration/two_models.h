/* Two small models unlike each other, for the tests of a daemon serving
 * several models: written by kvd-gguf-gen into a fresh temporary folder. */
#pragma once

#include <stddef.h>

/* Makes the folder from tmpl (mkdtemp's "...XXXXXX") into dir (cap 64) and
 * writes a: llama, f32 weights, 2 layers, vocabulary 500; b: qwen2, f16
 * weights, 3 layers, vocabulary 700, other head counts (paths cap 128).
 * $KVD_TOOLS_DIR has kvd-gguf-gen. 0, or -1 when any step failed. */
int two_models_make(const char *tmpl, char *dir, char *a, char *b);
/* Removes both files and the folder. */
void two_models_remove(const char *dir, const char *a, const char *b);
