"""vLLM's custom proposer, `RedraftProposer`, driven exactly as vLLM drives one.

vLLM is not installed here (it needs a CUDA build of torch), so these tests play its part:
- building the proposer as vllm/v1/spec_decode/custom_class_proposer.py
  (`create_custom_proposer`) does: import the config's dotted path, call the class with the
  `VllmConfig` alone, require a callable `propose`; then `GPUModelRunner.load_model`
  (vllm/v1/worker/gpu_model_runner.py) hands `load_model` the target model;
- the persistent batch as vllm/v1/worker/gpu_input_batch.py's `InputBatch` keeps it: int32
  `token_ids_cpu` of shape (max_num_reqs, max_model_len) and int32 `num_tokens_no_spec`,
  changed in place between steps; a new request fills a hole or is appended
  (`add_request`), a finished one leaves a hole (`remove_request`) that `condense` fills with
  the last rows, and `swap_states` swaps two rows when the batch is reordered;
- each step as `GPUModelRunner` does after sampling: `_bookkeeping_sync` writes each row's
  sampled tokens into `token_ids_cpu` and advances `num_tokens_no_spec` (a row still in a
  chunked prefill gets an empty list), then `propose_draft_token_ids` calls
  `drafter.propose(sampled_token_ids, input_batch.num_tokens_no_spec,
  input_batch.token_ids_cpu, slot_mappings=...)` once for all rows and takes one list of
  draft tokens per row back.
The draft service is a real `redraft serve`; the target, in the greedy test, the real default
model.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest
from redraft.datastore import build_datastore
from redraft.datastore.drafting import DraftSettings, new_session_drafter
from redraft.datastore.drafting.session_drafter import DEFAULT_PARAMS
from redraft.datastore.service.client import DraftClient
from redraft.decoder.engines.streams import EngineConfigError
from redraft.proto.tree import PLD, Tree, best_chain

from ...conftest import free_port, wait_until
from ..conftest import have_default_model
from .conftest import NEW_TOKENS, QUESTIONS, GreedySequence

pytestmark = pytest.mark.skipif(not have_default_model(), reason="default model not installed")

PROPOSER = "redraft.decoder.engines.vllm.RedraftProposer"


def vllm_config(k: int, max_model_len: int = 512, additional: dict | None = None):
    """The fields of a `VllmConfig` the proposer reads."""
    spec = SimpleNamespace(method="custom_class", model=PROPOSER, num_speculative_tokens=k)
    return SimpleNamespace(speculative_config=spec,
                           model_config=SimpleNamespace(max_model_len=max_model_len),
                           additional_config=additional or {})


def create_proposer(config):
    """What vLLM's create_custom_proposer and GPUModelRunner.load_model do with the class."""
    module_path, class_name = config.speculative_config.model.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_path), class_name)
    proposer = cls(config)
    assert callable(getattr(proposer, "propose", None))
    if hasattr(proposer, "load_model"):
        proposer.load_model(object())  # the target model: unused by redraft
    return proposer


class InputBatch:
    """The part of vLLM's persistent batch a custom proposer sees (module docstring)."""

    def __init__(self, max_num_reqs: int = 8, max_model_len: int = 512) -> None:
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens_no_spec = np.zeros(max_num_reqs, dtype=np.int32)
        self.req_ids: list[str | None] = []

    @property
    def num_reqs(self) -> int:
        return sum(r is not None for r in self.req_ids)

    def add_request(self, req_id: str, token_ids: list[int], index: int | None = None) -> int:
        if index is None:
            index = len(self.req_ids)
            self.req_ids.append(req_id)
        else:
            self.req_ids[index] = req_id
        self.token_ids_cpu[index, :len(token_ids)] = token_ids
        self.num_tokens_no_spec[index] = len(token_ids)
        return index

    def remove_request(self, req_id: str) -> int:
        index = self.req_ids.index(req_id)
        self.req_ids[index] = None
        return index

    def condense(self) -> None:
        """Move the last rows into the holes, lowest hole first."""
        while None in self.req_ids:
            hole = self.req_ids.index(None)
            last = max(i for i, r in enumerate(self.req_ids) if r is not None) \
                if self.num_reqs else -1
            if last < hole:
                break
            n = int(self.num_tokens_no_spec[last])
            self.token_ids_cpu[hole, :n] = self.token_ids_cpu[last, :n]
            self.num_tokens_no_spec[hole] = n
            self.req_ids[hole], self.req_ids[last] = self.req_ids[last], None
        del self.req_ids[self.num_reqs:]

    def swap_states(self, i: int, j: int) -> None:
        self.req_ids[i], self.req_ids[j] = self.req_ids[j], self.req_ids[i]
        self.num_tokens_no_spec[[i, j]] = self.num_tokens_no_spec[[j, i]]
        row = self.token_ids_cpu[i].copy()
        self.token_ids_cpu[i] = self.token_ids_cpu[j]
        self.token_ids_cpu[j] = row

    def context(self, req_id: str) -> list[int]:
        i = self.req_ids.index(req_id)
        return self.token_ids_cpu[i, :self.num_tokens_no_spec[i]].tolist()


def engine_step(proposer, batch: InputBatch, sampled: dict[str, list[int]],
                by_keyword: bool = False) -> dict[str, list]:
    """Book this step's sampled tokens, then one `propose` for every row; {req_id: drafts}.
    `by_keyword`: as the earlier `CustomClassProposer` wrapper of
    vllm/v1/spec_decode/custom_class_proposer.py called it, every argument by name."""
    lists = []
    for i, req_id in enumerate(batch.req_ids):
        tokens = list(sampled.get(req_id, []))
        start = int(batch.num_tokens_no_spec[i])
        batch.token_ids_cpu[i, start:start + len(tokens)] = tokens
        batch.num_tokens_no_spec[i] = start + len(tokens)
        lists.append(tokens)
    if by_keyword:
        drafts = proposer.propose(sampled_token_ids=lists,
                                  num_tokens_no_spec=batch.num_tokens_no_spec,
                                  token_ids_cpu=batch.token_ids_cpu, slot_mappings=None)
    else:
        drafts = proposer.propose(lists, batch.num_tokens_no_spec, batch.token_ids_cpu,
                                  slot_mappings=None)
    assert isinstance(drafts, list) and len(drafts) == batch.num_reqs
    assert all(isinstance(d, list) and all(type(t) is int for t in d) for d in drafts)
    return dict(zip(batch.req_ids, drafts))


@pytest.fixture()
def service_env(monkeypatch, service):
    """The engines' `service`, unpaced: whole chains, what the service drafted."""
    monkeypatch.setenv("REDRAFT_ADAPTIVE", "0")
    return service


def service_chain(client: DraftClient, proposer, context: list[int], k: int) -> list[int]:
    """The best chain of the server's tree for `context` (a stateless Propose)."""
    source = proposer.drafts.source
    tree = client.propose(context, source.params, source.fingerprint())
    return best_chain(tree, k).tokens


def pld_chain(proposer, context: list[int], k: int) -> list[int]:
    """The chain prompt lookup alone drafts for `context` in process."""
    asked = proposer.drafts.source.options.params
    settings = DraftSettings(DEFAULT_PARAMS.replace(budget=asked.budget,
                                                    max_depth=asked.max_depth,
                                                    sources=frozenset({PLD})))
    return best_chain(new_session_drafter(context, settings).propose(), k).tokens


def test_chains_are_the_services_best_chains_as_rows_move(service_env, plain_answers):
    k = 5
    proposer = create_proposer(vllm_config(k))
    batch = InputBatch()
    prompts = {f"r{i}": plain_answers[q][0] for i, q in enumerate(QUESTIONS)}
    outputs = {f"r{i}": plain_answers[q][1] for i, q in enumerate(QUESTIONS)}
    made = {rid: 0 for rid in prompts}  # output tokens booked per request
    keys: dict[str, int] = {}
    client = DraftClient(service_env.address, timeout=10)

    def run(step: int, prefilling=()) -> None:
        sampled = {}
        for rid in batch.req_ids:
            if rid in prefilling:
                continue  # a chunked prefill: nothing sampled, the prompt is all there
            n = 1 + step % 3  # one sampled token, and 0-2 accepted drafts
            sampled[rid] = outputs[rid][made[rid]:made[rid] + n]
            made[rid] += n
        drafts = engine_step(proposer, batch, sampled)
        for i, rid in enumerate(batch.req_ids):
            key = proposer.keys[i]
            assert keys.setdefault(rid, key) == key, f"{rid} changed sequence at step {step}"
            if rid in prefilling:
                assert drafts[rid] == []
            else:
                want = service_chain(client, proposer, batch.context(rid), k)
                assert drafts[rid] == want, (step, rid)
        assert len(set(proposer.keys)) == batch.num_reqs

    for rid in ("r0", "r1", "r2"):
        batch.add_request(rid, prompts[rid])
    run(0, prefilling={"r2"})
    run(1, prefilling={"r2"})
    run(2)
    batch.swap_states(0, 2)  # the batch reordered
    run(3)
    batch.remove_request("r0")  # r0 finished; r3 arrives and takes its row
    batch.add_request("r3", prompts["r3"], index=batch.req_ids.index(None))
    batch.condense()
    run(4, prefilling={"r3"})
    run(5)
    batch.remove_request("r1")  # r1 finished: the last row moves into its hole
    batch.condense()
    assert batch.req_ids == ["r2", "r3"]
    for step in range(6, 10):
        run(step)
    drafted = sum(len(d) for d in engine_step(proposer, batch, {}).values())
    assert drafted == 0  # rows that sampled nothing get no drafts
    # The server saw one Batch call per step that had rows to draft (steps 0-9), drafting
    # every row that sampled; r0 and r1 were ended on it, r2 and r3 are all it holds.
    stats = client.stats()
    assert stats["batch_calls"] == 10
    assert stats["batch_steps"] == 2 + 2 + 3 + 3 + 2 + 3 + 2 * 4
    assert stats["sessions_active"] == 2
    assert len(proposer.drafts._batch) == 2 and len(proposer.rows) == 2
    assert proposer.stats["errors"] == 0 and proposer.drafts.source.failures == 0
    assert proposer.stats["drafted_tokens"] > 0
    m, s = proposer.metrics, proposer.stats  # the counters Prometheus reads
    assert (m.drafts, m.num_draft_tokens) == (s["drafted_rows"], s["drafted_tokens"])
    assert m.num_accepted_tokens == s["accepted_tokens"] > 0 and m.steps == s["steps"]
    proposer.close()  # the engine shuts down: its sequences end on the server
    assert client.stats()["sessions_active"] == 0
    client.close()


def test_drafts_stop_at_max_model_len(service_env, plain_answers):
    """Each row's chain is at most k long and never runs past max_model_len."""
    prompt, output = plain_answers[QUESTIONS[0]]
    k, room = 8, 12
    limit = len(prompt) + room
    proposer = create_proposer(vllm_config(k, max_model_len=limit))
    batch = InputBatch(max_model_len=limit)
    batch.add_request("r0", prompt)
    made, lengths = 0, []
    while made < room:
        n = 4 if made == 0 else 2  # the first token and three accepted, then two a step
        drafts = engine_step(proposer, batch, {"r0": output[made:made + n]},
                             by_keyword=made > 0)
        made += n
        lengths.append(len(drafts["r0"]))
        assert lengths[-1] <= min(k, room - made), lengths
    assert lengths[-1] == 0  # the context is at max_model_len
    # the answer is in the corpus: the chains filled the room left
    assert lengths[:-1] == [min(k, room - m) for m in range(4, room, 2)], lengths
    proposer.close()


def test_a_dead_service_falls_back_to_prompt_lookup_and_is_used_again(
        monkeypatch, servers, answers_store, plain_answers):
    port = free_port()
    serve = servers.start(answers_store, "--port", str(port))
    monkeypatch.setenv("REDRAFT_SERVICE", serve.address)
    monkeypatch.setenv("REDRAFT_LEARN", "0")
    monkeypatch.setenv("REDRAFT_ADAPTIVE", "0")  # whole chains: what the service drafted
    monkeypatch.setenv("REDRAFT_RETRY_AFTER", "1")
    k = 6
    proposer = create_proposer(vllm_config(k))
    batch = InputBatch()
    outputs = {}
    for i, q in enumerate(QUESTIONS[:3]):
        batch.add_request(f"r{i}", plain_answers[q][0])
        outputs[f"r{i}"] = plain_answers[q][1]
    made = 0

    def step() -> dict[str, list]:
        nonlocal made
        sampled = {rid: outputs[rid][made:made + 2] for rid in batch.req_ids}
        made += 2
        return engine_step(proposer, batch, sampled)

    step()
    assert proposer.drafts.calls == 1
    serve.kill()
    drafts = step()  # the call fails: prompt lookup in process, no exception
    source = proposer.drafts.source
    assert source.failures == 1 and proposer.stats["errors"] == 0
    for rid in batch.req_ids:
        assert drafts[rid] == pld_chain(proposer, batch.context(rid), k)
    drafts = step()  # still within the retry delay: the service is left alone
    assert source.failures == 1 and proposer.drafts.calls == 1
    servers.start(answers_store, "--port", str(port))
    # Back: once the retry delay is over, a step goes to the service again (gRPC may still
    # be backing off its reconnect for up to a second: such a step fails over to prompt
    # lookup like the one above, and the next delay is waited out).
    deadline = time.monotonic() + 15
    while proposer.drafts.calls == 1:
        assert time.monotonic() < deadline, "the service was not used again"
        wait_until(source.service_usable, timeout=5)
        drafts = step()
    assert proposer.drafts.calls == 2 and source.failures <= 3
    assert proposer.stats["errors"] == 0
    with DraftClient(serve.address, timeout=10) as client:
        for rid in batch.req_ids:
            assert drafts[rid] == service_chain(client, proposer, batch.context(rid), k)
    proposer.close()


def test_a_full_server_refuses_a_row_which_drafts_by_prompt_lookup_until_there_is_room(
        monkeypatch, servers, answers_store, plain_answers):
    """Three rows, a server holding two sequences: the third row's open is refused
    (RESOURCE_EXHAUSTED, that entry alone); it drafts by prompt lookup in process and is
    offered to the service again every step, which takes it in the call that ends a
    finished row's sequence (ends go before opens)."""
    serve = servers.start(answers_store, "--port", "0", "--max-sessions", "2")
    monkeypatch.setenv("REDRAFT_SERVICE", serve.address)
    monkeypatch.setenv("REDRAFT_LEARN", "0")
    monkeypatch.setenv("REDRAFT_ADAPTIVE", "0")  # whole chains: what the service drafted
    k = 4
    proposer = create_proposer(vllm_config(k))
    batch = InputBatch()
    outputs, made = {}, {}
    for i, q in enumerate(QUESTIONS[:3]):
        batch.add_request(f"r{i}", plain_answers[q][0])
        outputs[f"r{i}"], made[f"r{i}"] = plain_answers[q][1], 0
    client = DraftClient(serve.address, timeout=10)

    def step() -> dict[str, list]:
        sampled = {}
        for rid in batch.req_ids:
            sampled[rid] = outputs[rid][made[rid]:made[rid] + 1]
            made[rid] += 1
        return engine_step(proposer, batch, sampled)

    drafts = step()
    assert drafts["r2"] == pld_chain(proposer, batch.context("r2"), k)
    for rid in ("r0", "r1"):
        assert drafts[rid] == service_chain(client, proposer, batch.context(rid), k)
    batch.remove_request("r0")  # r0 finished: r2 moves into its row
    batch.condense()
    for _ in range(2):  # r0's sequence is kept while absent for up to grace (2) steps
        drafts = step()
        assert drafts["r2"] == pld_chain(proposer, batch.context("r2"), k)
        assert client.stats()["sessions_active"] == 2
    drafts = step()  # r0 ends first in this call, so its slot opens r2 in the same call
    assert client.stats()["sessions_active"] == 2
    for rid in ("r1", "r2"):
        assert drafts[rid] == service_chain(client, proposer, batch.context(rid), k)
    assert len(proposer.drafts._batch) == 2
    assert proposer.drafts.source.failures == 0 and proposer.stats["errors"] == 0
    client.close()
    proposer.close()


def test_an_unreachable_service_at_start_drafts_by_prompt_lookup(monkeypatch, plain_answers):
    monkeypatch.setenv("REDRAFT_SERVICE", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("REDRAFT_ADAPTIVE", "0")
    proposer = create_proposer(vllm_config(4))
    batch = InputBatch()
    prompt, output = plain_answers[QUESTIONS[0]]
    batch.add_request("r0", prompt + prompt[:3])  # its own tokens repeat: PLD drafts
    drafts = engine_step(proposer, batch, {"r0": output[:1]})
    assert proposer.drafts.source.failures == 1
    assert drafts["r0"] == pld_chain(proposer, batch.context("r0"), 4)
    proposer.close()


@pytest.mark.slow
@pytest.mark.parametrize("where", ["service", "datastore"])
def test_greedy_engine_with_redraft_chains_equals_plain(
        where, monkeypatch, servers, answers_store, default_model, plain_answers):
    """A greedy engine on the real default model: two requests, two more arriving later,
    each leaving when done; every step the proposer drafts all rows, each row's chain is
    verified against the target's argmax. Output must equal plain greedy decoding."""
    monkeypatch.setenv("REDRAFT_LEARN", "0")
    if where == "service":
        monkeypatch.setenv("REDRAFT_SERVICE", servers.start(answers_store, "--port", "0").address)
    else:
        monkeypatch.setenv("REDRAFT_DATASTORE", answers_store)
    model, _ = default_model
    proposer = create_proposer(vllm_config(6))
    batch = InputBatch()
    running: dict[str, GreedySequence] = {}
    done: dict[str, GreedySequence] = {}
    drafts: dict[str, list[int]] = {}
    arrivals = {0: QUESTIONS[:2], 3: QUESTIONS[2:]}
    step = 0
    while step == 0 or running:
        for q in arrivals.get(step, []):
            rid = f"r{QUESTIONS.index(q)}"
            hole = batch.req_ids.index(None) if None in batch.req_ids else None
            batch.add_request(rid, plain_answers[q][0], index=hole)
            running[rid] = GreedySequence(model, plain_answers[q][0])
        batch.condense()
        sampled = {rid: seq.step(Tree.chain(drafts.get(rid, [])))
                   for rid, seq in running.items()}
        drafts = engine_step(proposer, batch, sampled)
        for rid in [r for r, s in running.items() if len(s.output) >= NEW_TOKENS]:
            done[rid] = running.pop(rid)  # the scheduler finishes it: its row empties
            batch.remove_request(rid)
        step += 1
    for rid, seq in done.items():
        q = QUESTIONS[int(rid[1:])]
        assert seq.output[:NEW_TOKENS] == plain_answers[q][1], rid
    accepted = sum(s.accepted for s in done.values())
    forwards = sum(s.forwards for s in done.values())
    assert accepted >= NEW_TOKENS  # three answers are in the corpus
    assert forwards < len(QUESTIONS) * NEW_TOKENS
    assert proposer.stats["errors"] == 0 and proposer.drafts.source.failures == 0
    proposer.close()


def test_configuration_errors_are_one_clear_line(monkeypatch, answers_store, tmp_path):
    for name in ("REDRAFT_SERVICE", "REDRAFT_DATASTORE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(EngineConfigError, match="REDRAFT_SERVICE=HOST:PORT"):
        create_proposer(vllm_config(4))
    with pytest.raises(EngineConfigError, match="num_speculative_tokens"):
        create_proposer(vllm_config(None))
    monkeypatch.setenv("REDRAFT_SERVICE", "nowhere")
    with pytest.raises(EngineConfigError, match="HOST:PORT"):
        create_proposer(vllm_config(4))
    monkeypatch.setenv("REDRAFT_BUDGET", "lots")
    with pytest.raises(EngineConfigError, match="budget"):
        create_proposer(vllm_config(4))
    monkeypatch.delenv("REDRAFT_BUDGET")
    # the vLLM config's additional_config["redraft"] overrides the environment
    config = vllm_config(4, additional={"redraft": {"service": None, "datastore": answers_store,
                                                    "corpora": "answers"}})
    proposer = create_proposer(config)
    assert proposer.drafts.source.reader is not None
    assert proposer.drafts.source.options.params.corpora == ("answers",)
    assert proposer.drafts.source.options.params.max_depth == 4
    proposer.close()
    with pytest.raises(EngineConfigError, match="unknown redraft engine options"):
        create_proposer(vllm_config(4, additional={"redraft": {"adress": "x"}}))
    token_file = tmp_path / "token"
    token_file.write_text("secret\n")
    monkeypatch.setenv("REDRAFT_SERVICE", f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}")
    monkeypatch.setenv("REDRAFT_TOKEN_FILE", str(token_file))
    proposer = create_proposer(vllm_config(4))  # replicas, a token: nobody answers
    assert proposer.drafts.source.failures == 1
    proposer.close()


def test_the_module_loads_without_vllm_or_torch():
    code = ("import sys, redraft.decoder.engines.vllm as m\n"
            "assert m.RedraftProposer\n"
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("bad", [-5, 1 << 32])
def test_a_row_holding_an_id_the_wire_cannot_carry_costs_that_row_alone(
        monkeypatch, servers, tmp_path, bad):
    """A negative id (int32 rows) or one past 2^32 (int64 rows) in one row: before, the
    client refused the whole call, counted it as a service failure for every row, and the
    local fallback raised too, so no row drafted at any step."""
    rng = np.random.default_rng(13)
    docs = [rng.integers(1, 500, 60).tolist() for _ in range(10)]
    store = str(tmp_path / "ds")
    build_datastore(None, store, documents=docs, fingerprint="sha256:rows", vocab_size=512)
    serve = servers.start(store, "--port", "0")
    monkeypatch.setenv("REDRAFT_SERVICE", serve.address)
    monkeypatch.setenv("REDRAFT_ADAPTIVE", "0")
    k = 4
    proposer = create_proposer(vllm_config(k))
    batch = InputBatch()
    if bad >= 1 << 31:
        batch.token_ids_cpu = batch.token_ids_cpu.astype(np.int64)
    batch.add_request("good", docs[0][:20])
    batch.add_request("bad", docs[1][:10] + [bad] + docs[1][10:20])
    client = DraftClient(serve.address, timeout=10)
    for i in range(3):
        drafts = engine_step(proposer, batch, {"good": docs[0][20 + i:21 + i],
                                               "bad": docs[1][20 + i:21 + i]})
        assert drafts["good"] == service_chain(client, proposer, batch.context("good"), k)
        assert drafts["good"] and drafts["bad"] == []
    assert proposer.drafts.source.failures == 0 and proposer.stats["errors"] == 0
    client.close()
    proposer.close()
