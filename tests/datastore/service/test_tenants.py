"""Tenant keys keep learned outputs apart whatever the server's configuration later is:
outputs learned under a token are never drafted for a session that did not present it,
after a restart without auth either, whatever tenant that session declares; names persisted
before keys map safely; and memory stays bounded in the number of tenants."""

from __future__ import annotations

import hashlib
import random
import time
from concurrent.futures import ThreadPoolExecutor

from redraft.datastore import Reader, append_corpus, build_datastore
from redraft.datastore.service.client import DraftClient, DraftParams
from redraft.datastore.service.tenants import (
    is_key,
    persisted_key,
    session_key,
    shareable,
    token_key,
)

FP = "sha256:tenants-test"
VOCAB = 3000
RNG = random.Random(77)
DOCS = [[RNG.randrange(1, 1000) for _ in range(80)] for _ in range(10)]
PROMPT = [RNG.randrange(1, 1000) for _ in range(30)]
SECRETS = [[RNG.randrange(1000, VOCAB) for _ in range(60)] for _ in range(3)]
LEARNED_ONLY = DraftParams(budget=16, max_depth=8, sources=("learned",))
TOKEN = "tenant-a-secret"
LEGACY_HEX = hashlib.sha256(f"Bearer {TOKEN}".encode()).hexdigest()[:16]  # the old naming


def make_store(tmp_path, learned=()) -> str:
    path = str(tmp_path / "ds")
    build_datastore(None, path, documents=DOCS, fingerprint=FP, vocab_size=VOCAB, corpus="c")
    if learned:
        append_corpus(None, path, documents=list(learned), fingerprint=FP, corpus="learned")
    return path


def drafted(client: DraftClient, secret: list[int], tenant: str) -> list[int]:
    """What a one-off call (it learns nothing) drafts from learned outputs after the prompt
    and the secret's first 8 tokens."""
    return client.propose(PROMPT + secret[:8], LEARNED_ONLY, tenant=tenant).tokens


def test_keys_never_collide_and_legacy_names_map_safely():
    key = token_key(TOKEN)
    assert key.startswith("k:") and len(key) == 66 and TOKEN not in key
    assert session_key(key, "") == key and session_key(key, "x") == f"{key}/x"
    declared = [session_key("", name) for name in ("", key, key[2:], f"token-{LEGACY_HEX}")]
    assert all(k.startswith("t:") for k in declared) and key not in declared
    assert persisted_key(key, []) == key and persisted_key("t:bob", []) == "t:bob"
    assert persisted_key(f"learned:token-{LEGACY_HEX}", [key]) == key
    assert persisted_key(f"learned:token-{LEGACY_HEX}/x", [key]) == f"{key}/x"
    assert persisted_key(f"learned:token-{LEGACY_HEX}", []) is None  # token not configured
    assert persisted_key(f"learned:token-{LEGACY_HEX}", [token_key("other")]) is None
    assert persisted_key("learned:bob", [key]) == "t:bob"
    assert persisted_key("learned:", []) == "t:"
    assert persisted_key("some-file.txt", [key]) is None
    assert all(is_key(k) for k in (key, f"{key}/x", "t:", "t:bob", "t:" + "x" * 200))
    assert not any(is_key(k) for k in ("", "bob", "k:", "k:" + "AB" * 32, key + "0",
                                       f"{key}/\n", "t:\x00", "t:" + "x" * 201))
    assert shareable("t:bob", []) and shareable(f"{key}/x", [key])
    assert not shareable(key, []) and not shareable(f"{key}/x", [token_key("other")])


def test_outputs_learned_under_a_token_stay_its_own_after_a_restart_without_auth(
        tmp_path, servers, until):
    store = make_store(tmp_path)
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN + "\n")
    with_auth = ("--port", "0", "--token-file", str(token_file))
    a = servers.start(store, *with_auth)
    with DraftClient(a.address, token=TOKEN) as c:
        with c.session(PROMPT, DraftParams(budget=4), FP) as s:
            s.step(SECRETS[0])
        assert drafted(c, SECRETS[0], "")[:4] == SECRETS[0][8:12]
    assert a.stop() == 0  # persisted at shutdown
    with Reader(store) as r:
        assert [name for _, name, _ in r.documents("learned")] == [token_key(TOKEN)]
    b = servers.start(store, "--port", "0")  # the attack: no auth, any declared tenant
    key = token_key(TOKEN)
    guesses = ["", f"token-{LEGACY_HEX}", key, key[2:], f"{key}/", f"learned:{key}", TOKEN,
               f"token-{LEGACY_HEX}/x"]
    with DraftClient(b.address) as c:
        until(lambda: c.stats()["learned_docs"] == 1)  # it is loaded, and still no one's
        for tenant in guesses:
            assert drafted(c, SECRETS[0], tenant) == [], tenant
    assert b.stop() == 0
    c2 = servers.start(store, *with_auth)  # the token's holder gets it back
    with DraftClient(c2.address, token=TOKEN) as c:
        until(lambda: drafted(c, SECRETS[0], "")[:4] == SECRETS[0][8:12])
    assert c2.stop() == 0


def test_outputs_persisted_under_legacy_names_map_to_their_tenants_only(
        tmp_path, servers, until):
    store = make_store(tmp_path, [
        (f"learned:token-{LEGACY_HEX}", PROMPT[-16:] + SECRETS[0]),
        ("learned:bob", PROMPT[-16:] + SECRETS[1]),
        (f"learned:token-{LEGACY_HEX}/x", PROMPT[-16:] + SECRETS[2]),
    ])
    open_server = servers.start(store, "--port", "0")
    with DraftClient(open_server.address) as c:
        until(lambda: drafted(c, SECRETS[1], "bob")[:4] == SECRETS[1][8:12])
        assert c.stats()["learned_docs"] == 1  # the token tenants' are not even loaded
        for tenant in (f"token-{LEGACY_HEX}", f"token-{LEGACY_HEX}/x", "x", ""):
            assert drafted(c, SECRETS[0], tenant) == [] and drafted(c, SECRETS[2], tenant) == []
    assert open_server.stop() == 0
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN + "\n")
    authed = servers.start(store, "--port", "0", "--token-file", str(token_file))
    with DraftClient(authed.address, token=TOKEN) as c:
        until(lambda: c.stats()["learned_docs"] == 3)
        assert drafted(c, SECRETS[0], "")[:4] == SECRETS[0][8:12]
        assert drafted(c, SECRETS[2], "x")[:4] == SECRETS[2][8:12]
        assert drafted(c, SECRETS[0], "x") == [] and drafted(c, SECRETS[1], "bob") == []
    assert authed.stop() == 0


def test_thousands_of_tenants_keep_memory_bounded(tmp_path, servers):
    store = make_store(tmp_path)
    serve = servers.start(store, "--port", "0", "--learn-max-tokens", "1000",
                          "--learn-persist-seconds", "0")

    def sessions(part: int) -> None:
        with DraftClient(serve.address, timeout=30) as c:
            for t in range(part, 5000, 4):
                with c.session(PROMPT, DraftParams(budget=1), FP, tenant=f"t{t}") as s:
                    s.step([1000 + t % 2000] * 10)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(sessions, range(4)))
    with DraftClient(serve.address) as c:
        st = c.stats()
    assert st["sessions_opened"] == 5000 and st["learned_tokens"] <= 1000
    assert st["learned_pools"] == st["learned_docs"] <= 1000 // 26 + 1  # 16 + 10 tokens each
    assert serve.stop() == 0


def test_learn_global_shares_a_token_s_outputs_with_no_one_without_it_after_a_restart_or_on_a_replica(  # noqa: E501
        tmp_path, servers, until):
    store = make_store(tmp_path)
    token_file = tmp_path / "tokens"
    token_file.write_text(TOKEN + "\n")
    common = ("--port", "0", "--learn", "global")
    authed = (*common, "--token-file", str(token_file))
    a = servers.start(store, *authed, "--learn-persist-seconds", "600")
    replica = servers.start(store, *common)  # no auth, the same datastore and logs
    with DraftClient(a.address, token=TOKEN) as c:
        with c.session(PROMPT, DraftParams(budget=4), FP) as s:
            s.step(SECRETS[0])
        assert drafted(c, SECRETS[0], "")[:4] == SECRETS[0][8:12]
    with DraftClient(replica.address) as c:
        until(lambda: c.stats()["learned_records_replayed"] > 0)  # it read the log
        with c.session(PROMPT, DraftParams(budget=4), FP) as s:  # its own: shared
            s.step(SECRETS[1])
        time.sleep(0.6)  # syncs enough for anything replayed to be in the index
        for tenant in ("", "x", token_key(TOKEN)):
            assert drafted(c, SECRETS[0], tenant) == [], tenant
            assert drafted(c, SECRETS[1], tenant)[:4] == SECRETS[1][8:12]
    assert a.stop() == 0 and replica.stop() == 0  # both persisted
    with Reader(store) as r:
        assert sorted(name for _, name, _ in r.documents("learned")) == [token_key(TOKEN), "t:"]
    b = servers.start(store, *common)  # restarted without auth
    with DraftClient(b.address) as c:
        until(lambda: drafted(c, SECRETS[1], "")[:4] == SECRETS[1][8:12])  # loaded
        for tenant in ("", "x", f"token-{LEGACY_HEX}", token_key(TOKEN)):
            assert drafted(c, SECRETS[0], tenant) == [], tenant
    assert b.stop() == 0
    c2 = servers.start(store, *authed)  # the token's holder shares it again
    with DraftClient(c2.address, token=TOKEN) as c:
        until(lambda: drafted(c, SECRETS[0], "")[:4] == SECRETS[0][8:12])
    assert c2.stop() == 0
