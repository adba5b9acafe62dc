/* The fixed conversations both chat template tests render: each template's
 * expected output for these is committed under tests/text/expected/
 * (written once with the reference renderer: test_chat_template_ref
 * --write-expected DIR). */
#ifndef KVD_TEST_CHAT_CASES_H
#define KVD_TEST_CHAT_CASES_H

#include <stdbool.h>
#include <stddef.h>

#include "chat_template.h"

static const char *const chat_templates[] = {
    "chatml",       "deepseek-coder", "gemma",      "gemma-2",           "llama-2",
    "llama-3",      "llama-3.1",      "llama-3.2",  "llama-3.3",         "mistral-nemo",
    "mistral-v0.2", "mistral-v1",     "mistral-v3", "mistral-v3-tekken", "mistral-v7",
    "phi-3",        "phi-3.5",        "qwen2",      "qwen2.5",           "qwen3",
    "smollm2",      "smollm3",        "zephyr",
};
#define N_CHAT_TEMPLATES (sizeof(chat_templates) / sizeof(chat_templates[0]))

struct chat_case {
    const struct chat_msg *msgs;
    size_t n;
    bool gen;
    const char *bos, *eos;
};

static const struct chat_msg cc_sys3[] = {
    {"system", "You are a helpful assistant"},
    {"user", "Hello"},
    {"assistant", "Hi there"},
    {"user", "Who are you"},
    {"assistant", "   I am an assistant   "},
    {"user", "Another question"},
};
static const struct chat_msg cc_user1[] = {{"user", "Bonjour, ça va? 中文 😀 \"q\" \\ {{ x }}"}};
static const struct chat_msg cc_ws[] = {
    {"user", "\n\t  spaced out  \n"},
    {"assistant", ""},
    {"user", "  "},
};
static const struct chat_msg cc_sys_only[] = {{"system", "Only a system prompt.\n"}};

static const struct chat_case chat_cases[] = {
    {cc_sys3, 6, true, "<s>", "</s>"},
    {cc_sys3, 6, false, "<|begin_of_text|>", "<|eot_id|>"},
    {cc_user1, 1, true, "<s>", "</s>"},
    {cc_ws, 3, false, "", ""},
    {cc_sys_only, 1, true, "<bos>", "<eos>"},
};
#define N_CHAT_CASES (sizeof(chat_cases) / sizeof(chat_cases[0]))

/* Conversations with tools, as OpenAI requests carry them ({"messages",
 * "tools"}): rendered through tool_render (tool_call.h) for each template;
 * the reference's output is tests/text/expected/NAME.tools.K.txt. */
static const char *const chat_tool_cases[] = {
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", "
    "\"content\": \"Weather in Paris?\"}, {\"role\": \"assistant\", \"content\": null, "
    "\"tool_calls\": [{\"id\": \"call_abcdefghijkl\", \"type\": \"function\", \"function\": "
    "{\"name\": \"get_weather\", \"arguments\": \"{\\\"location\\\": \\\"Paris\\\"}\"}}]}, "
    "{\"role\": \"tool\", \"tool_call_id\": \"call_abcdefghijkl\", \"content\": \"21 C\"}, "
    "{\"role\": \"assistant\", \"content\": \"It is 21 C.\"}, {\"role\": \"user\", "
    "\"content\": \"Thanks\"}], \"tools\": [{\"type\": \"function\", \"function\": {\"name\": "
    "\"get_weather\", \"description\": \"Get the weather\", \"parameters\": {\"type\": "
    "\"object\", \"properties\": {\"location\": {\"type\": \"string\"}}, \"required\": "
    "[\"location\"]}}}]}",
    "{\"messages\": [{\"role\": \"user\", \"content\": \"Time in Tokyo and 2+3?\"}, "
    "{\"role\": \"assistant\", \"content\": \"\", \"tool_calls\": [{\"id\": \"A1b2C3d4E\", "
    "\"type\": \"function\", \"function\": {\"name\": \"clock\", \"arguments\": "
    "\"{\\\"tz\\\": \\\"Asia/Tokyo\\\"}\"}}, {\"id\": \"Z9y8X7w6V\", \"type\": "
    "\"function\", \"function\": {\"name\": \"calc\", \"arguments\": "
    "\"{\\\"expr\\\": \\\"2+3\\\"}\"}}]}, {\"role\": \"tool\", \"tool_call_id\": "
    "\"A1b2C3d4E\", \"content\": \"09:00\"}, {\"role\": \"tool\", \"tool_call_id\": "
    "\"Z9y8X7w6V\", \"content\": \"5\"}], \"tools\": [{\"type\": \"function\", "
    "\"function\": {\"name\": \"clock\", \"parameters\": {\"type\": \"object\", "
    "\"properties\": {\"tz\": {\"type\": \"string\"}}}}}, {\"type\": \"function\", "
    "\"function\": {\"name\": \"calc\", \"description\": \"Évalue «expr»\", \"parameters\": "
    "{\"type\": \"object\", \"properties\": {\"expr\": {\"type\": \"string\"}}, "
    "\"required\": [\"expr\"]}}}]}",
};
#define N_CHAT_TOOL_CASES (sizeof(chat_tool_cases) / sizeof(chat_tool_cases[0]))

/* strftime_now's clock in both tests (2026-12-03 12:00 UTC, with TZ=UTC). */
#define CHAT_FIXED_NOW 1796299200

#endif
