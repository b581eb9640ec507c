"""Real clients against a running `jaxlearn serve`: the `openai` SDK (a chat tool loop, a
streamed tool loop through its streaming helper, the Responses API streamed and not),
`openai-agents` (an agent with a function tool run to completion, over Chat Completions and
over Responses) and the `anthropic` SDK (a tool round trip, streamed and not).

Run it in a venv with the clients (never the test environment):

    python -m venv /tmp/clients
    /tmp/clients/bin/pip install openai openai-agents anthropic jsonschema
    tools/jaxlearn serve --model SmolLM2-135M-Instruct.Q4_1.gguf --port 8123 &
    /tmp/clients/bin/python tools/bench/agent_clients_check.py --url http://127.0.0.1:8123 \\
        --out tools/bench/results/agent_clients [--record packages/serve/tests/fixtures/clients]

Every request goes through a recording proxy in this process; `--record DIR` writes each
exchange (path, request body, status, response body or SSE events) as DIR/NAME.json, the
recorded pairs the serve tests replay. `--out DIR/results.json` gets each check's outcome:
what the client returned (tool calls, arguments checked with `jsonschema`, final text).
A check fails only if the client raises or a call does not validate; a model answering
with text where a call was allowed is reported, not failed.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import http.server
import json
import pathlib
import platform
import sys
import threading
import time
import traceback
import urllib.parse
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from common import host_cpu  # noqa: E402

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "City name"},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": WEATHER_SCHEMA}}


def weather(city: str, unit: str = "celsius") -> str:
    return json.dumps({"city": city, "temperature": 21 if unit == "celsius" else 70,
                       "unit": unit, "sky": "clear"})


# ---- the recording proxy -----------------------------------------------------------------


class Recorder:
    def __init__(self, upstream: str):
        u = urllib.parse.urlparse(upstream)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.exchanges: list[dict[str, Any]] = []
        self.label = "unlabelled"
        recorder = self

        class Proxy(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def _forward(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else b""
                conn = http.client.HTTPConnection(recorder.host, recorder.port, timeout=600)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "connection", "accept-encoding")}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                ctype = resp.getheader("Content-Type", "")
                recorder.exchanges.append({
                    "label": recorder.label, "method": self.command, "path": self.path,
                    "request": json.loads(body) if body else None, "status": resp.status,
                    "content_type": ctype,
                    "response": data.decode() if "event-stream" in ctype else (
                        json.loads(data) if data else None)})
                self.send_response(resp.status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


# ---- the checks ----------------------------------------------------------------------------


def check_args(arguments: str) -> dict[str, Any]:
    import jsonschema

    args = json.loads(arguments)
    jsonschema.validate(args, WEATHER_SCHEMA)
    return args


def openai_chat_tool_loop(base: str, model: str) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none")
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL],
                                           tool_choice="required", max_tokens=96)
    msg = first.choices[0].message
    calls = msg.tool_calls or []
    assert calls, f"no tool call: {msg}"
    messages.append(msg.model_dump(exclude_none=True))
    for c in calls:
        args = check_args(c.function.arguments)
        messages.append({"role": "tool", "tool_call_id": c.id, "content": weather(**args)})
    final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL],
                                           max_tokens=64)
    return {"finish_reason": first.choices[0].finish_reason,
            "tool_calls": [c.model_dump() for c in calls],
            "final_finish_reason": final.choices[0].finish_reason,
            "final": final.choices[0].message.content,
            "final_tool_calls": len(final.choices[0].message.tool_calls or [])}


def openai_streamed_tool_calls(base: str, model: str) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none")
    kwargs: dict[str, Any] = dict(
        model=model, messages=[{"role": "user", "content": "Weather in Oslo and in Rome?"}],
        tools=[WEATHER_TOOL], tool_choice="required", max_tokens=160)
    deltas = 0
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            deltas += event.type == "tool_calls.function.arguments.delta"
        final = stream.get_final_completion()
    msg = final.choices[0].message
    calls = msg.tool_calls or []
    assert calls, "no tool call"
    checked = [{"name": c.function.name, "arguments": check_args(c.function.arguments)}
               for c in calls]
    # The loop's next turn, streamed too: the results, then the answer.
    kwargs["messages"] = [*kwargs["messages"], msg.model_dump(exclude_none=True), *[
        {"role": "tool", "tool_call_id": c.id, "content": weather(**a["arguments"])}
        for c, a in zip(calls, checked)]]
    kwargs.update(tool_choice="auto", max_tokens=320, temperature=0)
    with client.chat.completions.stream(**kwargs) as stream:
        chunks = sum(1 for _ in stream)
        answer = stream.get_final_completion().choices[0]
    return {"argument_delta_events": deltas, "finish_reason": final.choices[0].finish_reason,
            "tool_calls": checked, "answer_events": chunks,
            "answer_finish_reason": answer.finish_reason, "answer": answer.message.content,
            "answer_tool_calls": len(answer.message.tool_calls or [])}


def openai_responses(base: str, model: str) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="none")
    tool = {"type": "function", "name": "get_weather", "description": "Current weather",
            "parameters": WEATHER_SCHEMA, "strict": True}
    r = client.responses.create(model=model, input="What is the weather in Lima?",
                                instructions="Use the tools.", tools=[tool],
                                tool_choice="required", max_output_tokens=96)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls, f"no function_call item: {r.output}"
    args = check_args(calls[0].arguments)
    follow = client.responses.create(model=model, tools=[tool], max_output_tokens=64, input=[
        {"role": "user", "content": "What is the weather in Lima?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": calls[0].name,
         "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": weather(**args)}])
    events: list[str] = []
    with client.responses.stream(model=model, input="Weather in Cairo?", tools=[tool],
                                 tool_choice="required", max_output_tokens=96) as stream:
        for ev in stream:
            events.append(ev.type)
        streamed = stream.get_final_response()
    scalls = [o for o in streamed.output if o.type == "function_call"]
    assert scalls, "no streamed function_call"
    return {"tool_call": {"name": calls[0].name, "arguments": args},
            "follow_up_text": follow.output_text, "follow_up_status": follow.status,
            "streamed_call": {"name": scalls[0].name,
                              "arguments": check_args(scalls[0].arguments)},
            "stream_event_types": sorted(set(events))}


def openai_agents(base: str, model: str, api: str) -> dict[str, Any]:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[dict[str, Any]] = []

    @function_tool
    def get_weather(city: str, unit: str) -> str:
        """Current weather in a city.

        Args:
            city: City name.
            unit: celsius or fahrenheit.
        """
        calls.append({"city": city, "unit": unit})
        return weather(city, unit if unit in ("celsius", "fahrenheit") else "celsius")

    client = AsyncOpenAI(base_url=base + "/v1", api_key="none")
    klass = OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel
    agent = Agent(name="weather", instructions="Answer with the weather tool.",
                  tools=[get_weather], model=klass(model=model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=320,
                                                 temperature=0))
    result = asyncio.run(Runner.run(agent, "What is the weather in Tokyo?", max_turns=4,
                                    run_config=RunConfig(tracing_disabled=True)))
    assert calls, "the tool was never called"
    return {"tool_calls": calls, "final_output": result.final_output,
            "items": [type(i).__name__ for i in result.new_items]}


def anthropic_tool_round_trip(base: str, model: str) -> dict[str, Any]:
    import anthropic

    client = anthropic.Anthropic(base_url=base, api_key="none")
    tool = {"name": "get_weather", "description": "Current weather in a city",
            "input_schema": WEATHER_SCHEMA}
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Nairobi?"}]
    first = client.messages.create(model=model, max_tokens=96, tools=[tool], messages=messages,
                                   tool_choice={"type": "any"})
    uses = [b for b in first.content if b.type == "tool_use"]
    assert uses, f"no tool_use: {first.content}"
    check_args(json.dumps(uses[0].input))
    messages += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                               "content": weather(**uses[0].input)}]}]
    final = client.messages.create(model=model, max_tokens=64, tools=[tool], messages=messages,
                                   stop_sequences=["\n\n"])
    with client.messages.stream(model=model, max_tokens=96, tools=[tool],
                                tool_choice={"type": "tool", "name": "get_weather"},
                                messages=[{"role": "user", "content": "Weather in Quito?"}]
                                ) as stream:
        streamed = stream.get_final_message()
    suses = [b for b in streamed.content if b.type == "tool_use"]
    assert suses, "no streamed tool_use"
    return {"stop_reason": first.stop_reason, "tool_use": {"name": uses[0].name,
                                                           "input": uses[0].input},
            "final_stop_reason": final.stop_reason,
            "final_text": "".join(b.text for b in final.content if b.type == "text"),
            "streamed_tool_use": {"name": suses[0].name,
                                  "input": check_args(json.dumps(suses[0].input))}}


CHECKS: dict[str, Callable[[str, str], dict[str, Any]]] = {
    "openai_chat_tool_loop": openai_chat_tool_loop,
    "openai_streamed_tool_calls": openai_streamed_tool_calls,
    "openai_responses": openai_responses,
    "openai_agents_chat": lambda b, m: openai_agents(b, m, "chat"),
    "openai_agents_responses": lambda b, m: openai_agents(b, m, "responses"),
    "anthropic_tool_round_trip": anthropic_tool_round_trip,
}


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("openai", "openai-agents", "anthropic"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "missing"
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the running jaxlearn serve")
    ap.add_argument("--model", default=None, help="model name (default: /v1/models' first)")
    ap.add_argument("--out", required=True, help="directory for results.json")
    ap.add_argument("--record", default=None, help="directory for the recorded exchanges")
    ap.add_argument("--only", default=None, help="comma-separated check names")
    args = ap.parse_args()
    rec = Recorder(args.url)
    model = args.model
    if model is None:
        u = urllib.parse.urlparse(args.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("GET", "/v1/models")
        model = json.loads(conn.getresponse().read())["data"][0]["id"]
    results: dict[str, Any] = {"url": args.url, "model": model, "clients": versions(),
                               "python": platform.python_version(), "host": host_cpu(),
                               "checks": {}}
    names = args.only.split(",") if args.only else list(CHECKS)
    failed = 0
    for name in names:
        rec.label = name
        t0 = time.monotonic()
        try:
            out = {"ok": True, **CHECKS[name](rec.url, model)}
        except Exception as e:  # A client error is the check's result.
            failed += 1
            out = {"ok": False, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-2000:]}
        out["seconds"] = round(time.monotonic() - t0, 2)
        results["checks"][name] = out
        print(f"{name}: {'ok' if out['ok'] else 'FAILED ' + out['error']} "
              f"({out['seconds']} s)", file=sys.stderr)
    outdir = pathlib.Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    if args.record:
        rdir = pathlib.Path(args.record)
        rdir.mkdir(parents=True, exist_ok=True)
        for i, ex in enumerate(rec.exchanges):
            (rdir / f"{ex['label']}_{i:02d}.json").write_text(json.dumps(ex, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
