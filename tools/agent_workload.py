"""An agent-like workload for serving benchmarks, deterministic from a seed.

Why: agents are where drafting from what was served pays most. Every request starts with the
same long tool preamble (a tool list with JSON schemas), the model answers with JSON tool
calls, and each tool's result is fed back as the next turn, so request t of a task holds the
preamble, the task and every earlier turn, the model's own outputs included. A drafter that
learns from served outputs (redraft's service, SuffixDecoding) sees most of each prompt and
the shape of each answer before.

    from agent_workload import Task, tasks, messages, tool_result
    for task in tasks(seed=0, n=4):
        outputs = []
        for turn in range(3):
            chat = messages(task, outputs)       # chat messages: apply the chat template
            outputs.append(model(chat))          # the model's answer: a JSON tool call
        # tool_result(task, turn, output) is what messages() feeds back after each output

Tool results depend only on the task's seed, the turn and the call the model made (its tool
name and arguments): the same model output always gets the same result, so methods whose
outputs are identical see identical prompts.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass

TOOLS: list[dict] = [
    {"name": "search_files", "description": "Find files in the repository whose path or "
     "contents match a query.",
     "parameters": {"type": "object", "properties": {
         "query": {"type": "string", "description": "Words or a regular expression."},
         "path": {"type": "string", "description": "Folder to search under.", "default": "."},
         "max_results": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10}},
         "required": ["query"]}},
    {"name": "read_file", "description": "Read lines of a text file in the repository.",
     "parameters": {"type": "object", "properties": {
         "path": {"type": "string"},
         "start_line": {"type": "integer", "minimum": 1, "default": 1},
         "end_line": {"type": "integer", "minimum": 1}},
         "required": ["path"]}},
    {"name": "run_tests", "description": "Run the test suite or one test file and report "
     "failures.",
     "parameters": {"type": "object", "properties": {
         "target": {"type": "string", "description": "A test file or folder."},
         "keyword": {"type": "string", "description": "Only tests whose name matches."}},
         "required": ["target"]}},
    {"name": "query_database", "description": "Run a read-only SQL query on the orders "
     "database.",
     "parameters": {"type": "object", "properties": {
         "sql": {"type": "string"},
         "limit": {"type": "integer", "minimum": 1, "maximum": 1000, "default": 100}},
         "required": ["sql"]}},
    {"name": "get_weather", "description": "Current weather and a 3-day forecast for a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string"},
         "units": {"type": "string", "enum": ["metric", "imperial"], "default": "metric"}},
         "required": ["city"]}},
    {"name": "send_email", "description": "Send an email on the user's behalf.",
     "parameters": {"type": "object", "properties": {
         "to": {"type": "string", "format": "email"},
         "subject": {"type": "string"},
         "body": {"type": "string"}},
         "required": ["to", "subject", "body"]}},
    {"name": "create_calendar_event", "description": "Add an event to the user's calendar.",
     "parameters": {"type": "object", "properties": {
         "title": {"type": "string"},
         "date": {"type": "string", "format": "date"},
         "time": {"type": "string", "description": "HH:MM, 24-hour."},
         "duration_minutes": {"type": "integer", "minimum": 5, "default": 30}},
         "required": ["title", "date", "time"]}},
    {"name": "http_get", "description": "Fetch a URL and return its status and the first "
     "2000 characters of its body.",
     "parameters": {"type": "object", "properties": {
         "url": {"type": "string", "format": "uri"},
         "headers": {"type": "object", "additionalProperties": {"type": "string"}}},
         "required": ["url"]}},
]

PREAMBLE = (
    "You are an assistant that completes tasks by calling tools. Answer every turn with "
    "exactly one tool call and nothing else, as one JSON object of the form "
    '{"name": "<tool name>", "arguments": {<arguments>}}. After each call you get the '
    "tool's result as JSON; call the next tool until the task is done, then call "
    '{"name": "finish", "arguments": {"summary": "<what you did>"}}.\n\n'
    "Available tools (JSON schema of each tool's arguments):\n"
    + "\n".join(json.dumps(t, indent=2) for t in TOOLS)
)

CITIES = ["Lisbon", "Oslo", "Nairobi", "Osaka", "Lima", "Toronto", "Krakow", "Hanoi",
          "Denver", "Porto", "Seoul", "Cairo"]
MODULES = ["billing", "auth", "scheduler", "parser", "cache", "exporter", "search", "upload"]
PEOPLE = ["ana", "bo", "chen", "dara", "eli", "fatima", "goran", "hana"]
TEMPLATES = [
    "The tests in tests/test_{module}.py fail since yesterday. Find the cause in the "
    "{module} module and tell {person}@example.com what is wrong.",
    "Check the weather in {city} for the next three days and, if it rains, move my "
    "{module} review to a day without rain at 10:00.",
    "How many orders did customer {number} place last month and what did they spend in "
    "total? Email the answer to {person}@example.com.",
    "Find every place the {module} module reads the setting '{setting}' and show me the "
    "function that parses it.",
    "Fetch https://status.example.com/{module} and, if any service is down, create a "
    "calendar event 'incident review {module}' tomorrow at 09:30.",
    "List the five largest orders shipped to {city} this year, then send {person}@example.com "
    "a short summary with their totals.",
]
SETTINGS = ["timeout_seconds", "max_retries", "batch_size", "cache_dir", "log_level"]


@dataclass(frozen=True)
class Task:
    """One agent task: its user request and the seed its tool results are drawn from."""

    id: str
    goal: str
    seed: int


def tasks(seed: int, n: int) -> list[Task]:
    """`n` tasks drawn from `seed` (the same seed, the same tasks)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        goal = rng.choice(TEMPLATES).format(
            module=rng.choice(MODULES), person=rng.choice(PEOPLE), city=rng.choice(CITIES),
            number=rng.randrange(1000, 99999), setting=rng.choice(SETTINGS))
        out.append(Task(f"{seed}-{i}", goal, rng.randrange(1 << 30)))
    return out


def parse_call(text: str) -> dict | None:
    """The first JSON object in `text` that names a tool ({"name": str, ...}), or None."""
    decoder = json.JSONDecoder()
    at = text.find("{")
    while at >= 0:
        try:
            value, _ = decoder.raw_decode(text, at)
        except ValueError:
            value = None
        if isinstance(value, dict) and isinstance(value.get("name"), str):
            return value
        at = text.find("{", at + 1)
    return None


def tool_result(task: Task, turn: int, output: str) -> str:
    """The JSON result of the tool call in `output` at `turn` of `task` (an error result when
    no call is found or the tool is unknown)."""
    call = parse_call(output)
    if call is None:
        return json.dumps({"error": "no tool call found: answer with one JSON object "
                           '{"name": ..., "arguments": {...}}'})
    name = call["name"]
    args = call.get("arguments")
    args = args if isinstance(args, dict) else {}
    key = json.dumps([task.seed, turn, name, args], sort_keys=True, default=str)
    rng = random.Random(int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big"))
    make = _RESULTS.get(name)
    if make is None:
        return json.dumps({"error": f"unknown tool {name!r}",
                           "available": [t["name"] for t in TOOLS] + ["finish"]})
    return json.dumps({"tool": name, "result": make(rng, args)})


def messages(task: Task, outputs: list[str]) -> list[dict]:
    """The chat for the next turn of `task` after the model's `outputs` so far: the tool
    preamble, the task, then each output and its tool result in turn."""
    chat = [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": task.goal}]
    for turn, text in enumerate(outputs):
        chat.append({"role": "assistant", "content": text})
        chat.append({"role": "user",
                     "content": "Tool result: " + tool_result(task, turn, text)})
    return chat


# ---- tool results ----------------------------------------------------------------------
def _path(rng: random.Random) -> str:
    return f"src/{rng.choice(MODULES)}/{rng.choice(['core', 'api', 'utils', 'models'])}.py"


def _search(rng: random.Random, args: dict) -> dict:
    hits = [{"path": _path(rng), "line": rng.randrange(1, 400),
             "text": f"    {rng.choice(SETTINGS)} = config.get('{rng.choice(SETTINGS)}')"}
            for _ in range(rng.randrange(1, 5))]
    return {"query": str(args.get("query", "")), "matches": hits}


def _read(rng: random.Random, args: dict) -> dict:
    start = args.get("start_line") if isinstance(args.get("start_line"), int) else 1
    setting = rng.choice(SETTINGS)
    lines = [f"def load_{setting}(config):",
             f"    value = config.get('{setting}', {rng.randrange(1, 100)})",
             "    if value is None:",
             f"        raise ValueError('{setting} is required')",
             "    return int(value)"]
    return {"path": str(args.get("path", _path(rng))), "start_line": start,
            "lines": lines}


def _tests(rng: random.Random, args: dict) -> dict:
    failed = rng.randrange(0, 3)
    return {"target": str(args.get("target", "tests")), "passed": rng.randrange(5, 60),
            "failed": failed,
            "failures": [{"test": f"test_{rng.choice(SETTINGS)}_{i}",
                          "error": "AssertionError: expected 30, got None"}
                         for i in range(failed)]}


def _sql(rng: random.Random, args: dict) -> dict:
    rows = [{"order_id": rng.randrange(10000, 99999), "city": rng.choice(CITIES),
             "total": round(rng.uniform(5, 900), 2)} for _ in range(rng.randrange(1, 6))]
    return {"columns": ["order_id", "city", "total"], "rows": rows}


def _weather(rng: random.Random, args: dict) -> dict:
    days = [{"day": d, "condition": rng.choice(["sunny", "cloudy", "rain", "showers"]),
             "high": rng.randrange(5, 32), "low": rng.randrange(-5, 15)}
            for d in ("today", "tomorrow", "day after")]
    return {"city": str(args.get("city", rng.choice(CITIES))), "forecast": days}


def _email(rng: random.Random, args: dict) -> dict:
    return {"status": "sent", "message_id": f"<{rng.randrange(1 << 40):x}@example.com>"}


def _event(rng: random.Random, args: dict) -> dict:
    return {"status": "created", "event_id": f"evt_{rng.randrange(1 << 32):08x}",
            "title": str(args.get("title", ""))}


def _http(rng: random.Random, args: dict) -> dict:
    down = rng.random() < 0.3
    return {"status": 200, "body": json.dumps({"services": [
        {"name": m, "status": "down" if down and i == 0 else "up"}
        for i, m in enumerate(rng.sample(MODULES, 3))]})}


def _finish(rng: random.Random, args: dict) -> dict:
    return {"status": "done"}


_RESULTS = {"search_files": _search, "read_file": _read, "run_tests": _tests,
            "query_database": _sql, "get_weather": _weather, "send_email": _email,
            "create_calendar_event": _event, "http_get": _http, "finish": _finish}
