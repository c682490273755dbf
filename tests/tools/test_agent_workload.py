"""The agent-like workload (tools/agent_workload.py): deterministic from its seed, a preamble
whose tool schemas are valid JSON, tool results that follow the model's call, and turns that
carry every earlier output."""

from __future__ import annotations

import json

from tools import agent_workload as aw

CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def test_tasks_are_the_seeds_and_differ_between_seeds():
    assert aw.tasks(7, 5) == aw.tasks(7, 5)
    assert aw.tasks(7, 5) != aw.tasks(8, 5)
    assert len({t.goal for t in aw.tasks(3, 20)}) > 10  # not one request repeated
    assert aw.tasks(7, 3) == aw.tasks(7, 5)[:3]


def test_preamble_lists_every_tool_with_its_schema_as_json():
    decoder = json.JSONDecoder()
    schemas = []
    at = aw.PREAMBLE.find('{\n  "name"')
    while at >= 0:
        value, end = decoder.raw_decode(aw.PREAMBLE, at)
        schemas.append(value)
        at = aw.PREAMBLE.find('{\n  "name"', end)
    assert schemas == aw.TOOLS
    assert all(t["parameters"]["type"] == "object" for t in schemas)
    assert len(aw.PREAMBLE) > 3000  # a long shared prefix, as agents' are


def test_parse_call_finds_the_first_tool_call():
    assert aw.parse_call("Sure! " + CALL + " and more")["arguments"] == {"city": "Oslo"}
    assert aw.parse_call('{"a": 1} then ' + CALL)["name"] == "get_weather"
    assert aw.parse_call('{"name": "x", "arguments": {"nested": {"k": [1, 2]}}}') == {
        "name": "x", "arguments": {"nested": {"k": [1, 2]}}}
    assert aw.parse_call("no call here {broken") is None
    assert aw.parse_call('{"name": 3}') is None


def test_tool_results_follow_the_call_and_are_deterministic():
    task = aw.tasks(0, 1)[0]
    first = aw.tool_result(task, 0, CALL)
    assert first == aw.tool_result(task, 0, "text around it " + CALL)
    result = json.loads(first)
    assert result["tool"] == "get_weather" and result["result"]["city"] == "Oslo"
    assert len(result["result"]["forecast"]) == 3
    other = '{"name": "get_weather", "arguments": {"city": "Lima"}}'
    assert json.loads(aw.tool_result(task, 0, other))["result"]["city"] == "Lima"
    assert "error" in json.loads(aw.tool_result(task, 0, "I cannot do that."))
    unknown = json.loads(aw.tool_result(task, 0, '{"name": "fly", "arguments": {}}'))
    assert "unknown tool" in unknown["error"] and "read_file" in unknown["available"]
    for tool in aw.TOOLS:  # every tool answers, whatever its arguments
        call = json.dumps({"name": tool["name"], "arguments": {"bogus": [1]}})
        assert json.loads(aw.tool_result(task, 2, call))["tool"] == tool["name"]


def test_each_turn_holds_the_preamble_the_task_and_every_earlier_output():
    task = aw.tasks(1, 1)[0]
    assert aw.messages(task, []) == [{"role": "system", "content": aw.PREAMBLE},
                                     {"role": "user", "content": task.goal}]
    outputs = [CALL, '{"name": "finish", "arguments": {"summary": "done"}}']
    chat = aw.messages(task, outputs)
    assert chat[:2] == aw.messages(task, [])
    assert [m["role"] for m in chat[2:]] == ["assistant", "user", "assistant", "user"]
    assert chat[2]["content"] == outputs[0] and chat[4]["content"] == outputs[1]
    assert chat[3]["content"] == "Tool result: " + aw.tool_result(task, 0, outputs[0])
    assert aw.messages(task, outputs[:1]) == chat[:4]  # a turn extends the one before
