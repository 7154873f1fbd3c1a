"""Agent frameworks' tool calling against `loopserve serve`, unchanged (docs/serving.md,
"Tool calling").

Runs against a server you started (`--base-url`, `--model`), e.g.

    loopserve serve --port 8000 --served-model-name loopserve-demo

in its own environment, so the frameworks are not the project's dependencies:

    python3 -m venv /tmp/agents && /tmp/agents/bin/pip install langchain-openai openai-agents \
        "pydantic-ai-slim[openai]" litellm
    /tmp/agents/bin/python scripts/agents_tools.py --base-url http://127.0.0.1:8000/v1

1. LangChain: `ChatOpenAI(...).bind_tools([get_weather], tool_choice="required")`, the
   tool run, its `ToolMessage` and the final answer.
2. The openai-agents SDK: an `Agent` with a `function_tool` over `OpenAIChatCompletionsModel`,
   `tool_choice="required"` for its first turn (the SDK resets it to auto after a call), run
   to its final output by `Runner.run`.
3. The openai-agents SDK over its default model, `OpenAIResponsesModel` (`POST
   /v1/responses`): the same agent, stopping at the tool's result
   (`tool_use_behavior="stop_on_first_tool"`: the demo model's free text would run to
   `max_tokens`, an incomplete response the SDK raises on), by `Runner.run` and by
   `Runner.run_streamed`; then once more letting the model answer the tool's result, which
   sends the call and its output back as input items (the demo model's answer runs to
   `max_tokens`, which the SDK raises on; the request is what is recorded).
4. Pydantic AI over `OpenAIChatModel` and `OpenAIResponsesModel`: an agent whose output is a
   Pydantic model (its default tool output: a `final_result` tool with `tool_choice`
   required) and one function tool, by `Agent.run` and `Agent.run_stream`; then the same
   output as native structured output (`NativeOutput`: a JSON schema response format).

5. LiteLLM's `completion` (what CrewAI, DSPy and aider call) over its `hosted_vllm/` and
   `openai/` providers: text, streamed text, a required call and the tool's result sent
   back, a Pydantic `response_format` (not recorded: LiteLLM sends them with its own client).

`--loops` picks which run (default: all five).

The embedded demo model writes no sensible text: what this shows is that the frameworks'
requests are accepted, their tool calls parse into the frameworks' own call objects, the
tools run and the loop ends. It prints one JSON line per step and exits non-zero on failure.
`--record FILE` writes every request body the frameworks sent, one JSON line each
(tests/fixtures/agent_tool_requests.jsonl holds such a recording of loops 1 and 2, which
tests/test_server_tools.py replays; tests/fixtures/agent_responses_requests.jsonl one of loop
3, which tests/test_server_responses.py replays; tests/fixtures/pydantic_ai_requests.jsonl
one of loop 4, which tests/test_server_frameworks.py replays).
"""

import argparse
import asyncio
import json
from typing import Annotated

try:
    import httpx
except ImportError:  # openai's own fork, which newer openai releases install instead
    import httpx2 as httpx

WEATHER = {"Paris": "22 C, sunny", "Oslo": "-3 C, snow"}
RECORDED: list[dict] = []


def _record(request: httpx.Request) -> None:
    RECORDED.append({"path": request.url.path, "body": json.loads(request.content)})


async def _record_async(request: httpx.Request) -> None:
    _record(request)


def say(step: str, **fields) -> None:
    print(json.dumps({"step": step, **fields}, default=str), flush=True)


def langchain_loop(base_url: str, model: str) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import Field

    @tool
    def get_weather(city: Annotated[str, Field(max_length=24)]) -> str:
        """The weather in a city."""
        return WEATHER.get(city, "12 C, cloudy")

    llm = ChatOpenAI(base_url=base_url, api_key="none", model=model, temperature=0,
                     max_tokens=200,
                     http_client=httpx.Client(event_hooks={"request": [_record]}))  # fmt: skip
    messages = [HumanMessage("What is the weather in Paris?")]
    first = llm.bind_tools([get_weather], tool_choice="required").invoke(messages)
    assert first.tool_calls, first
    say("langchain.tool_calls", calls=first.tool_calls)
    messages.append(first)
    for call in first.tool_calls:
        result = get_weather.invoke(call["args"])
        messages.append(ToolMessage(result, tool_call_id=call["id"]))
    final = llm.bind_tools([get_weather], tool_choice="none").invoke(messages)
    assert not final.tool_calls and isinstance(final.content, str), final
    say("langchain.final", content=final.content[:80])


def weather_agent(model_class: str, base_url: str, model: str, calls: list, **options):
    """The openai-agents SDK's `Agent` with a `get_weather` tool (each call appended to
    `calls`) over `agents.<model_class>` on a client that records its requests; `options`
    are `Agent`'s (`tool_use_behavior`, ...). Its first turn must call the tool."""
    import agents
    from agents import Agent, ModelSettings, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI
    from pydantic import Field

    set_tracing_disabled(True)  # no traces leave the machine

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=24)]) -> str:
        """The weather in a city."""
        calls.append(city)
        return WEATHER.get(city, "12 C, cloudy")

    client = AsyncOpenAI(base_url=base_url, api_key="none",
                         http_client=httpx.AsyncClient(event_hooks={"request": [_record_async]}))  # fmt: skip
    return Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=getattr(agents, model_class)(model=model, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=120),
        **options,
    )


async def agents_loop(base_url: str, model: str) -> None:
    from agents import Runner

    calls: list[str] = []
    agent = weather_agent("OpenAIChatCompletionsModel", base_url, model, calls)
    result = await Runner.run(agent, "What is the weather in Oslo?", max_turns=4)
    assert calls, "the agent called no tool"
    say("agents.tool_calls", cities=calls)
    say("agents.final", output=str(result.final_output)[:80])


async def agents_responses_loop(base_url: str, model: str) -> None:
    from agents import Runner

    calls: list[str] = []
    question = "What is the weather in Oslo?"
    for streamed in (False, True):
        agent = weather_agent("OpenAIResponsesModel", base_url, model, calls,
                              tool_use_behavior="stop_on_first_tool")  # fmt: skip
        if streamed:
            result = Runner.run_streamed(agent, question, max_turns=4)
            async for _ in result.stream_events():
                pass
        else:
            result = await Runner.run(agent, question, max_turns=4)
        assert calls, "the agent called no tool"
        say("agents.responses.final", streamed=streamed, cities=calls,
            output=str(result.final_output)[:80])  # fmt: skip
    # A second turn, as the SDK sends it (the call and its output as input items): its answer
    # is the demo model's free text, cut at max_tokens, which the SDK raises on.
    agent = agent.clone(tool_use_behavior="run_llm_again")
    before = len(RECORDED)
    try:
        await Runner.run(agent, question, max_turns=2)
    except Exception as err:  # noqa: BLE001 - the incomplete answer, reported below
        say("agents.responses.second_turn", error=type(err).__name__)
    assert len(RECORDED) - before == 2, "the SDK sent no second turn"


async def pydantic_ai_loop(base_url: str, model: str) -> None:
    """Pydantic AI over its chat completions and its Responses model: an agent whose output
    is a Pydantic model (its default tool output: a `final_result` tool, `tool_choice`
    required) with one function tool, run and streamed; then the same output as native
    structured output (`NativeOutput`: a JSON schema response format)."""
    from openai import AsyncOpenAI
    from pydantic import BaseModel, Field
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Weather(BaseModel):
        city: Annotated[str, Field(max_length=24)]
        summary: Annotated[str, Field(max_length=40)]

    client = AsyncOpenAI(base_url=base_url, api_key="none",
                         http_client=httpx.AsyncClient(event_hooks={"request": [_record_async]}))  # fmt: skip
    provider = OpenAIProvider(openai_client=client)
    settings = {"temperature": 0, "max_tokens": 120}

    async def run(label: str, llm) -> None:
        calls: list[str] = []
        agent = Agent(llm, output_type=Weather, instructions="Report the weather.",
                      model_settings=settings)  # fmt: skip

        @agent.tool_plain
        def get_weather(city: Annotated[str, Field(max_length=24)]) -> str:
            """The weather in a city."""
            calls.append(city)
            return WEATHER.get(city, "12 C, cloudy")

        result = await agent.run("What is the weather in Paris?")
        say(f"pydantic_ai.{label}.run", cities=calls, output=result.output.model_dump())
        async with agent.run_stream("What is the weather in Oslo?") as streamed:
            output = await streamed.get_output()
        say(f"pydantic_ai.{label}.stream", output=output.model_dump())
        native = Agent(llm, output_type=NativeOutput(Weather), model_settings=settings)
        result = await native.run("Name a city and its weather.")
        say(f"pydantic_ai.{label}.native", output=result.output.model_dump())

    await run("chat", OpenAIChatModel(model, provider=provider))
    await run("responses", OpenAIResponsesModel(model, provider=provider))


def litellm_loop(base_url: str, model: str) -> None:
    """LiteLLM's `completion` (what CrewAI, DSPy and aider call) over its `hosted_vllm/` and
    `openai/` providers: text, streamed text, a required call and the tool's result sent
    back, and a Pydantic `response_format`. LiteLLM's own HTTP client sends these, so they
    are not recorded."""
    import litellm
    from pydantic import BaseModel, Field

    class City(BaseModel):
        city: str = Field(max_length=12)

    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                             "required": ["city"]}}}]  # fmt: skip
    for provider in ("hosted_vllm", "openai"):
        settings = dict(
            model=f"{provider}/{model}", api_base=base_url, api_key="none", temperature=0
        )
        hello = [{"role": "user", "content": "Say hello."}]
        text = (
            litellm.completion(messages=hello, max_tokens=12, **settings).choices[0].message.content
        )
        chunks = litellm.completion(messages=hello, max_tokens=12, stream=True, **settings)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == text, (streamed, text)
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        first = litellm.completion(
            messages=question, tools=tools, tool_choice="required", max_tokens=80, **settings
        )
        message = first.choices[0].message
        assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls, first
        (call,) = message.tool_calls
        answer = WEATHER.get(json.loads(call.function.arguments)["city"], "12 C, cloudy")
        history = [
            *question,
            message.model_dump(),
            {"role": "tool", "tool_call_id": call.id, "content": answer},
        ]
        final = litellm.completion(messages=history, tools=tools, max_tokens=12, **settings)
        city = litellm.completion(
            messages=[{"role": "user", "content": "Name a city."}],
            response_format=City,
            max_tokens=60,
            **settings,
        )
        say(
            f"litellm.{provider}",
            text=text,
            call=call.function.arguments,
            final=final.choices[0].message.content,
            object=City.model_validate_json(city.choices[0].message.content),
        )


LOOPS = ("langchain", "agents", "agents-responses", "pydantic-ai", "litellm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="loopserve-demo")
    parser.add_argument("--record", default=None, help="write the request bodies sent here")
    parser.add_argument("--loops", default=",".join(LOOPS), help="which runs, comma-separated")
    args = parser.parse_args()
    loops = args.loops.split(",")
    if "langchain" in loops:
        langchain_loop(args.base_url, args.model)
    if "agents" in loops:
        asyncio.run(agents_loop(args.base_url, args.model))
    if "agents-responses" in loops:
        asyncio.run(agents_responses_loop(args.base_url, args.model))
    if "pydantic-ai" in loops:
        asyncio.run(pydantic_ai_loop(args.base_url, args.model))
    if "litellm" in loops:
        litellm_loop(args.base_url, args.model)
    if args.record:
        with open(args.record, "w") as out:
            for entry in RECORDED:
                out.write(json.dumps(entry) + "\n")
    say("done", requests=len(RECORDED))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
