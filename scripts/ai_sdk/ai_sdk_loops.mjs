// The Vercel AI SDK (`ai`) against `loopserve serve`, unchanged (docs/serving.md, "Tool
// calling"). Node, in its own folder, so the SDK is not a project dependency:
//
//     loopserve serve --port 8000 --served-model-name loopserve-demo
//     cd scripts/ai_sdk && npm install && node ai_sdk_loops.mjs --base-url http://127.0.0.1:8000/v1
//
// Over both of the SDK's OpenAI providers: `@ai-sdk/openai-compatible` (chat completions, what
// the SDK's docs name for vLLM and other OpenAI-compatible servers) and `@ai-sdk/openai`
// (its default model calls the Responses API; `.chat()` chat completions):
//
// 1. generateText and streamText, plain;
// 2. a tool loop: generateText with one tool, `toolChoice: "required"` on the first step and
//    "none" on the second (`prepareStep`), `stopWhen: isStepCount(2)`: the call parses into
//    the SDK's tool call, the tool runs, and its result goes back as a tool message (a
//    `function_call_output` item over Responses);
// 3. structured output: generateText with `Output.object` (a JSON schema response format).
//
// The embedded demo model writes no sensible text: what this shows is that the SDK's
// requests are accepted and its parsers accept the answers. One JSON line per step; a
// non-zero exit on failure. `--record FILE` writes every request body the SDK sent, one JSON
// line each (tests/fixtures/ai_sdk_requests.jsonl is such a recording, replayed by
// tests/test_server_frameworks.py).

import { writeFileSync } from "node:fs";
import { parseArgs } from "node:util";

import { createOpenAI } from "@ai-sdk/openai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";
import { generateText, isStepCount, Output, streamText, tool } from "ai";
import { z } from "zod";

const { values: args } = parseArgs({
  options: {
    "base-url": { type: "string", default: "http://127.0.0.1:8000/v1" },
    model: { type: "string", default: "loopserve-demo" },
    record: { type: "string" },
  },
});

const recorded = [];
async function recordingFetch(url, init) {
  recorded.push({ path: new URL(url).pathname, body: JSON.parse(init.body) });
  return fetch(url, init);
}

function say(step, fields = {}) {
  console.log(JSON.stringify({ step, ...fields }));
}

const WEATHER = { Paris: "22 C, sunny", Oslo: "-3 C, snow" };
const getWeather = tool({
  description: "The current weather in a city.",
  inputSchema: z.object({ city: z.string().max(12).describe("the city's name") }),
  execute: async ({ city }) => WEATHER[city] ?? `no report for ${city}`,
});

async function plain(label, model) {
  const settings = { model, maxOutputTokens: 12, temperature: 0, maxRetries: 0 };
  const text = await generateText({ ...settings, prompt: "Say hello." });
  say(`${label}.generate`, { text: text.text, finish: text.finishReason, usage: text.usage });
  const stream = streamText({ ...settings, prompt: "Say hello." });
  let streamed = "";
  for await (const delta of stream.textStream) streamed += delta;
  if (streamed !== text.text) throw new Error(`${label}: streamed ${streamed} != ${text.text}`);
  say(`${label}.stream`, { text: streamed, finish: await stream.finishReason });
}

async function toolLoop(label, model) {
  const result = await generateText({
    model,
    tools: { get_weather: getWeather },
    prompt: "What is the weather in Paris?",
    maxOutputTokens: 60,
    temperature: 0,
    maxRetries: 0,
    stopWhen: isStepCount(2),
    prepareStep: ({ stepNumber }) => ({ toolChoice: stepNumber === 0 ? "required" : "none" }),
  });
  const [first] = result.steps;
  if (!first.toolCalls.length) throw new Error(`${label}: the first step made no tool call`);
  if (result.steps.length !== 2) throw new Error(`${label}: ${result.steps.length} steps`);
  say(`${label}.tools`, {
    calls: first.toolCalls.map((call) => ({ name: call.toolName, input: call.input })),
    results: first.toolResults.map((r) => r.output),
    final: result.text.slice(0, 60),
  });
}

async function structured(label, model) {
  const schema = z.object({ city: z.string().max(12) });
  const result = await generateText({
    model,
    prompt: "Name a city.",
    output: Output.object({ schema }),
    maxOutputTokens: 60,
    temperature: 0,
    maxRetries: 0,
  });
  say(`${label}.object`, { object: result.output });
}

const compatible = createOpenAICompatible({
  name: "loopserve",
  baseURL: args["base-url"],
  includeUsage: true,
  supportsStructuredOutputs: true,
  fetch: recordingFetch,
});
const openai = createOpenAI({ baseURL: args["base-url"], apiKey: "none", fetch: recordingFetch });

const runs = [
  ["compatible", compatible.chatModel(args.model)],
  ["openai.responses", openai(args.model)],
  ["openai.chat", openai.chat(args.model)],
];
for (const [label, model] of runs) {
  await plain(label, model);
  await toolLoop(label, model);
  await structured(label, model);
}
if (args.record) {
  writeFileSync(args.record, recorded.map((entry) => JSON.stringify(entry) + "\n").join(""));
}
say("done", { requests: recorded.length });
