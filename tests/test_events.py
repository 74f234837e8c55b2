"""KV events: the raw log of the core becomes vLLM-shaped events, their bytes are vLLM's, and the
ZeroMQ publisher sends them the way vLLM's does.

The wire checks decode with a msgspec schema written here from vLLM's definitions, not with the
library's own code, and compare with bytes vLLM 0.33's encoder wrote. When the peers' vLLM
environment exists (``bench/.venv-peers/vllm``, made by ``bench/peers.py``), a child process in it
decodes our bytes with vLLM's own classes.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq

from lifecycle.errors import ConfigError, MalformedEvent, TornDown
from lifecycle.events import (
    END_OF_REPLAY,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventTranslator,
    ZmqEventPublisher,
    encode_batch,
)

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / "bench" / ".venv-peers" / "vllm" / "bin" / "python"
BLOCK_SIZE = 4
TOP_HASH = 2**64 - 1  # above int64: must stay unsigned on the wire
RECEIVE_TIMEOUT_MS = 10_000


# --- an independent schema of vLLM's wire format (vllm/distributed/kv_events.py) ---------------------


class WireStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, forbid_unknown_fields=True):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class WireRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, forbid_unknown_fields=True):
    block_hashes: list[int]
    medium: str | None


class WireCleared(msgspec.Struct, tag="AllBlocksCleared", forbid_unknown_fields=True):
    pass


class WireBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[WireStored | WireRemoved | WireCleared]
    data_parallel_rank: int | None


def decode(payload: bytes) -> WireBatch:
    return msgspec.msgpack.decode(payload, type=WireBatch)


#: What vLLM 0.33's ``msgspec.msgpack.Encoder`` wrote for ``KVEventBatch(ts=1.5, events=[BlockStored(
#: block_hashes=[2**64 - 1, 5], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
#: lora_id=None, medium="GPU", lora_name=None), BlockRemoved(block_hashes=[7], medium="GPU"),
#: AllBlocksCleared()])``.
VLLM_BYTES = bytes.fromhex(
    "93cb3ff800000000000093de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfffff"
    "ffffffffffff05b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f"
    "73697a6502a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c083a474797065ac426c6f636b"
    "52656d6f766564ac626c6f636b5f6861736865739107a66d656469756da347505581a474797065b0416c6c426c6f636b"
    "73436c6561726564c0"
)


def vllm_reference_batch() -> KVEventBatch:
    """The batch ``VLLM_BYTES`` encodes, built with lifecycle's classes."""
    stored = BlockStored(
        block_hashes=(TOP_HASH, 5), parent_block_hash=None, token_ids=(1, 2, 3, 4), block_size=2,
        lora_id=None, medium=MEDIUM_GPU, lora_name=None,
    )
    return KVEventBatch(ts=1.5, events=(stored, BlockRemoved(block_hashes=(7,), medium=MEDIUM_GPU), AllBlocksCleared()))


def stored_entry(hashes: list[int], parent: int | None = None, adapter_key: int = 0, first_token: int = 0) -> tuple[
    Any, ...]:
    """A raw ``stored`` entry as the core logs it: uint64 hashes, int32 tokens of whole blocks."""
    tokens = np.arange(first_token, first_token + len(hashes) * BLOCK_SIZE, dtype=np.int32)
    return ("stored", np.array(hashes, dtype=np.uint64), parent, tokens, adapter_key)


def translator(**kwargs: Any) -> KVEventTranslator:
    return KVEventTranslator(BLOCK_SIZE, clock=lambda: 123.25, **kwargs)


# === the translator =====================================================================================


def test_a_stored_entry_becomes_block_stored_with_its_hashes_parent_and_tokens() -> None:
    (event,) = translator().events([stored_entry([11, 12], parent=10, first_token=100)])
    assert event == BlockStored(
        block_hashes=(11, 12), parent_block_hash=10, token_ids=tuple(range(100, 108)), block_size=BLOCK_SIZE,
        lora_id=None, medium=MEDIUM_GPU, lora_name=None,
    )


def test_hashes_above_int64_stay_unsigned_python_ints() -> None:
    (event,) = translator().events([stored_entry([TOP_HASH], parent=TOP_HASH - 1)])
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (TOP_HASH,) and event.parent_block_hash == TOP_HASH - 1
    assert type(event.block_hashes[0]) is int


def test_an_adapter_key_is_named_by_adapter_of() -> None:
    names = {7: (3, "sql-lora")}
    (event,) = translator(adapter_of=names.get).events([stored_entry([1], adapter_key=7)])
    assert isinstance(event, BlockStored)
    assert (event.lora_id, event.lora_name) == (3, "sql-lora")


def test_adapter_key_0_means_no_adapter_and_is_never_looked_up() -> None:
    def adapter_of(key: int) -> tuple[int, str] | None:
        raise AssertionError(f"looked up adapter key {key}")

    (event,) = translator(adapter_of=adapter_of).events([stored_entry([1], adapter_key=0)])
    assert isinstance(event, BlockStored)
    assert (event.lora_id, event.lora_name) == (None, None)


def test_a_store_starting_a_salted_sequence_names_the_salt_in_its_first_blocks_extra_keys() -> None:
    salts = {7: "tenant-a"}
    first, later = translator(salt_of=salts.get).events(
        [stored_entry([1, 2], adapter_key=7), stored_entry([3], parent=2, adapter_key=7)]
    )
    assert isinstance(first, BlockStored) and isinstance(later, BlockStored)
    assert first.extra_keys == (("tenant-a",), None) and later.extra_keys is None  # vLLM's place for a salt
    payload = msgspec.msgpack.decode(encode_batch(KVEventBatch(ts=1.0, events=(first,))))
    assert payload[1][0]["extra_keys"] == [["tenant-a"], None]


def test_an_unsalted_key_has_no_extra_keys() -> None:
    (event,) = translator(salt_of=lambda key: None).events([stored_entry([1], adapter_key=7)])
    assert isinstance(event, BlockStored) and event.extra_keys is None


def test_stored_builds_the_event_of_a_tier_below_the_pool_with_its_tokens_and_parent() -> None:
    tokens = list(range(2 * BLOCK_SIZE))
    event = translator(medium=MEDIUM_CPU, adapter_of={7: (7, "chat")}.get).stored([11, 12], 10, tokens, 7)
    assert event == BlockStored(
        block_hashes=(11, 12), parent_block_hash=10, token_ids=tuple(tokens), block_size=BLOCK_SIZE, lora_id=7,
        medium=MEDIUM_CPU, lora_name="chat",
    )
    with pytest.raises(MalformedEvent, match="7 tokens for 2 blocks"):
        translator().stored([11, 12], None, tokens[:7])


def test_a_removed_entry_becomes_block_removed() -> None:
    (event,) = translator().events([("removed", np.array([5, TOP_HASH], dtype=np.uint64))])
    assert event == BlockRemoved(block_hashes=(5, TOP_HASH), medium=MEDIUM_GPU)


def test_a_cleared_entry_becomes_all_blocks_cleared() -> None:
    assert translator().events([("cleared",)]) == [AllBlocksCleared()]


def test_events_keep_the_order_of_the_log() -> None:
    log = [stored_entry([1]), ("removed", np.array([1], dtype=np.uint64)), ("cleared",), stored_entry([2])]
    kinds = [type(event) for event in translator().events(log)]
    assert kinds == [BlockStored, BlockRemoved, AllBlocksCleared, BlockStored]


def test_hand_written_entries_with_int_lists_translate_like_arrays() -> None:
    by_array = translator().events([stored_entry([1, 2], parent=9)])
    by_list = translator().events([("stored", [1, 2], 9, list(range(2 * BLOCK_SIZE)), 0)])
    assert by_list == by_array


def test_a_batch_is_stamped_by_the_clock_and_holds_the_events() -> None:
    batch = translator().batch([("cleared",)], data_parallel_rank=2)
    assert batch == KVEventBatch(ts=123.25, events=(AllBlocksCleared(),), data_parallel_rank=2)


def test_every_event_names_the_translator_medium() -> None:
    events = translator(medium=MEDIUM_CPU).events([stored_entry([1]), ("removed", [1])])
    assert [event.medium for event in events if not isinstance(event, AllBlocksCleared)] == ["CPU", "CPU"]


def test_tokens_that_are_not_whole_blocks_are_refused_naming_the_entry() -> None:
    bad = ("stored", np.array([1, 2], dtype=np.uint64), None, np.arange(7, dtype=np.int32), 0)
    with pytest.raises(MalformedEvent, match=r"raw event 1 .*7 tokens for 2 blocks of 4; expected 8"):
        translator().events([("cleared",), bad])


def test_a_negative_hash_is_refused() -> None:
    with pytest.raises(MalformedEvent, match=r"hash -1 is not an int in \[0, 2\*\*64\)"):
        translator().events([("removed", [-1])])


def test_an_entry_of_unknown_shape_is_refused() -> None:
    with pytest.raises(MalformedEvent, match=r"raw event 0 is \('evicted', 3\)"):
        translator().events([("evicted", 3)])


@pytest.mark.parametrize("block_size", [0, -4, 2.0, True])
def test_a_translator_needs_a_positive_int_block_size(block_size: Any) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        KVEventTranslator(block_size)


# === the wire format ====================================================================================


def test_encoded_bytes_are_the_bytes_vllm_writes_for_the_same_batch() -> None:
    assert encode_batch(vllm_reference_batch()) == VLLM_BYTES


def test_an_independent_schema_decodes_every_field_of_a_translated_batch() -> None:
    log = [stored_entry([TOP_HASH, 8], parent=6, adapter_key=1), ("removed", [TOP_HASH]), ("cleared",)]
    batch = translator(adapter_of=lambda key: (41, "chat")).batch(log, data_parallel_rank=3)
    wire = decode(encode_batch(batch))
    assert (wire.ts, wire.data_parallel_rank) == (123.25, 3)
    stored, removed, cleared = wire.events
    assert stored == WireStored(
        block_hashes=[TOP_HASH, 8], parent_block_hash=6, token_ids=list(range(2 * BLOCK_SIZE)),
        block_size=BLOCK_SIZE, lora_id=41, medium="GPU", lora_name="chat",
    )
    assert removed == WireRemoved(block_hashes=[TOP_HASH], medium="GPU")
    assert isinstance(cleared, WireCleared)


def test_an_optional_field_is_sent_only_when_set() -> None:
    plain = BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(0,), block_size=1, lora_id=None,
                        medium=MEDIUM_GPU, lora_name=None)
    keys = [list(msgspec.msgpack.decode(encode_batch(KVEventBatch(0.0, (event,))))[1][0])
            for event in (plain, dataclasses.replace(plain, group_idx=0))]
    assert keys[0] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                       "lora_name"]
    assert keys[1] == [*keys[0], "group_idx"]


def test_a_batch_without_a_rank_still_sends_three_elements() -> None:
    raw = msgspec.msgpack.decode(encode_batch(KVEventBatch(ts=2.0, events=())))
    assert raw == [2.0, [], None]


def vllm_decoded(tmp_path: Path, payload: bytes) -> dict[str, Any]:
    """``payload`` decoded by vLLM's own ``KVEventBatch`` in the peers' vLLM environment: whether it
    re-encodes to the same bytes, its stamp, rank and events (name, fields)."""
    (tmp_path / "batch.msgpack").write_bytes(payload)
    script = (
        "import json, sys, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch\n"
        "payload = open(sys.argv[1], 'rb').read()\n"
        "batch = msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload)\n"
        "print(json.dumps({'same_bytes': msgspec.msgpack.Encoder().encode(batch) == payload,\n"
        "                  'ts': batch.ts, 'rank': batch.data_parallel_rank,\n"
        "                  'events': [[type(e).__name__, msgspec.to_builtins(e)] for e in batch.events]}))\n"
    )
    result = subprocess.run([str(VLLM_PYTHON), "-c", script, str(tmp_path / "batch.msgpack")], capture_output=True,
                            text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    decoded: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return decoded


needs_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(), reason="the vLLM peer environment (bench/.venv-peers/vllm) is absent"
)


@needs_vllm
def test_vllm_own_classes_decode_our_bytes_and_reencode_them_identically(tmp_path: Path) -> None:
    log = [stored_entry([TOP_HASH, 8], parent=6, adapter_key=1), ("removed", [TOP_HASH, 3]), ("cleared",)]
    payload = encode_batch(translator(adapter_of=lambda key: (41, "chat")).batch(log, data_parallel_rank=0))
    seen = vllm_decoded(tmp_path, payload)
    assert seen["same_bytes"] and (seen["ts"], seen["rank"]) == (123.25, 0)
    assert [name for name, _ in seen["events"]] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    stored, removed = seen["events"][0][1], seen["events"][1][1]
    assert stored["block_hashes"] == [TOP_HASH, 8] and stored["parent_block_hash"] == 6
    assert (stored["lora_id"], stored["lora_name"], stored["medium"]) == (41, "chat", "GPU")
    assert removed["block_hashes"] == [TOP_HASH, 3]


def grouped_core_batch(kind: str, window: int) -> tuple[KVEventBatch, tuple[Any, ...]]:
    """The events of a core of a full group and one ``kind`` group of ``window`` tokens that cached
    one request of 4 blocks and evicted it, translated with the core's groups; and its groups."""
    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore

    core = KVCacheCore(BlockPool(16), BLOCK_SIZE, groups=[(kind, window, 0, BlockPool(16))], retention_interval=0,
                       events=True)
    core.finish(core.admit(list(range(4 * BLOCK_SIZE)), 4))
    core.evict(4)
    events = translator(groups=core.groups).events(core.take_events())
    return KVEventBatch(ts=123.25, events=tuple(events)), core.groups


@pytest.mark.parametrize(("kind", "window", "spec"), [
    ("sliding_window", 8, ("sliding_window", 8)), ("chunked_local", 12, ("chunked_local_attention", None)),
])
def test_a_groups_stored_events_name_its_spec_as_vllm_does(kind: str, window: int, spec: tuple[Any, ...]) -> None:
    batch, _ = grouped_core_batch(kind, window)
    stored = [e for e in batch.events if isinstance(e, BlockStored)]
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored] == [
        (0, "full_attention", None), (1, *spec),
    ]
    removed = [e for e in batch.events if isinstance(e, BlockRemoved)]
    assert {e.group_idx for e in removed} == {0, 1}


def test_a_one_group_cores_events_carry_no_group() -> None:
    from lifecycle._blockpool import BlockPool
    from lifecycle._kvcache import KVCacheCore

    core = KVCacheCore(BlockPool(16), BLOCK_SIZE, events=True)
    core.finish(core.admit(list(range(4 * BLOCK_SIZE)), 4))
    core.evict(4)
    events = translator(groups=core.groups).events(core.take_events())
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved"]
    assert [e.group_idx for e in events if isinstance(e, (BlockStored, BlockRemoved))] == [None, None]


def test_without_the_cores_groups_a_groups_events_carry_the_index_alone() -> None:
    entry = (*stored_entry([5]), 1)
    (event,) = translator().events([entry])
    assert isinstance(event, BlockStored)
    assert (event.group_idx, event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window) == (1, None, None)


def test_an_entry_of_a_group_the_core_does_not_have_is_malformed() -> None:
    groups = (("full", 0, 0), ("sliding_window", 8, 0))
    with pytest.raises(MalformedEvent, match="KV cache group 2 does not exist; the core has 2"):
        translator(groups=groups).events([(*stored_entry([5]), 2)])
    with pytest.raises(MalformedEvent, match="KV cache group 3 does not exist"):
        translator(groups=groups).events([("removed", np.array([5], dtype=np.uint64), 3)])


def test_a_group_of_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"groups\[1\] has kind 'ring'"):
        KVEventTranslator(BLOCK_SIZE, groups=(("full", 0, 0), ("ring", 8, 0)))


def test_a_models_events_name_each_groups_spec() -> None:
    from lifecycle.config import AttentionLayer, ModelConfig, SlidingWindowLayer
    from lifecycle.model import HybridModel

    config = ModelConfig(
        layers=(AttentionLayer(num_kv_heads=1, head_dim=4), SlidingWindowLayer(num_kv_heads=1, head_dim=4, window=8)),
        block_size=BLOCK_SIZE, num_blocks=(16, 16), max_model_len=64,
    )
    model = HybridModel(config, "host", events=True)
    try:
        seq = model.alloc_sequence_for(4 * BLOCK_SIZE + 1)
        model.attach_prefix(seq, list(range(4 * BLOCK_SIZE)), grow_to=4 * BLOCK_SIZE)
        model.finish_sequence(seq)
        stored = [e for e in model.take_events().events if isinstance(e, BlockStored)]
        assert {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored} == {
            (0, "full_attention", None), (1, "sliding_window", 8),
        }
    finally:
        model.teardown()


@needs_vllm
def test_vllm_own_classes_read_a_groups_spec_kind(tmp_path: Path) -> None:
    batch, _ = grouped_core_batch("sliding_window", 8)
    seen = vllm_decoded(tmp_path, encode_batch(batch))
    assert seen["same_bytes"]
    stored = [fields for name, fields in seen["events"] if name == "BlockStored"]
    assert [(e.get("group_idx"), e.get("kv_cache_spec_kind"), e.get("kv_cache_spec_sliding_window"))
            for e in stored] == [(0, "full_attention", None), (1, "sliding_window", 8)]
    removed = [fields for name, fields in seen["events"] if name == "BlockRemoved"]
    assert sorted(e.get("group_idx") for e in removed) == [0, 1]


# === the ZeroMQ publisher ================================================================================


def one_event_batch(block_hash: int, ts: float = 1.0, rank: int | None = None) -> KVEventBatch:
    return KVEventBatch(ts=ts, events=(BlockRemoved(block_hashes=(block_hash,), medium=MEDIUM_GPU),),
                        data_parallel_rank=rank)


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.term()


def publisher_on(context: zmq.Context[zmq.Socket[bytes]], **kwargs: Any) -> ZmqEventPublisher:
    return ZmqEventPublisher("tcp://127.0.0.1:*", context=context, **kwargs)


def subscriber(context: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher,
               topic: bytes = b"") -> zmq.Socket[bytes]:
    """A SUB socket that has provably joined: probe batches (ts -1) are published until one
    arrives (a subscription reaches a PUB socket some time after connecting)."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(publisher.endpoint)
    for _ in range(400):
        publisher.publish(one_event_batch(0, ts=-1.0))
        if sub.poll(25):
            return sub
    sub.close()
    pytest.fail("the subscriber never received a probe batch")


def receive_real(sub: zmq.Socket[bytes], count: int) -> list[list[bytes]]:
    """The next ``count`` messages that are not probes."""
    messages: list[list[bytes]] = []
    while len(messages) < count:
        assert sub.poll(RECEIVE_TIMEOUT_MS), f"received {len(messages)} of {count} batches"
        frames = sub.recv_multipart()
        if decode(frames[2]).ts != -1.0:
            messages.append(frames)
    return messages


def request_replay(context: zmq.Context[zmq.Socket[bytes]], publisher: ZmqEventPublisher,
                   first: int) -> list[list[bytes]]:
    """Ask the replay socket for the batches from ``first``; the frames of every answer (topic,
    seq, payload) up to and including the end marker."""
    assert publisher.replay_endpoint is not None
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(publisher.replay_endpoint)
    dealer.send_multipart([b"", first.to_bytes(8, "big")])
    answers: list[list[bytes]] = []
    try:
        while not answers or answers[-1][1] != END_OF_REPLAY:
            assert dealer.poll(RECEIVE_TIMEOUT_MS), f"no end marker after {len(answers)} answers"
            empty, *frames = dealer.recv_multipart()
            assert empty == b""
            answers.append(frames)
    finally:
        dealer.close()
    return answers


def test_a_batch_reaches_a_subscriber_as_topic_sequence_number_and_payload(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with publisher_on(context, topic="kv@worker0") as publisher:
        sub = subscriber(context, publisher)
        sent = vllm_reference_batch()
        publisher.publish(sent)
        ((topic, seq, payload),) = receive_real(sub, 1)
        sub.close()
    assert topic == b"kv@worker0" and len(seq) == 8
    assert payload == encode_batch(KVEventBatch(sent.ts, sent.events, data_parallel_rank=0))


def test_sequence_numbers_count_the_batches_sent_by_one(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with publisher_on(context) as publisher:
        sub = subscriber(context, publisher)
        for block_hash in (1, 2, 3):
            publisher.publish(one_event_batch(block_hash))
        received = receive_real(sub, 3)
        sub.close()
    numbers = [int.from_bytes(seq, "big") for _, seq, _ in received]
    assert numbers == [numbers[0], numbers[0] + 1, numbers[0] + 2]
    assert [decode(payload).events[0] for _, _, payload in received] == [WireRemoved([h], "GPU") for h in (1, 2, 3)]


def test_the_first_batch_is_number_0_and_replay_resends_from_the_number_asked(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with publisher_on(context, replay_endpoint="tcp://127.0.0.1:*") as publisher:
        for block_hash in (10, 11, 12):
            publisher.publish(one_event_batch(block_hash))
        assert publisher.flush(timeout_s=RECEIVE_TIMEOUT_MS / 1000)
        answers = request_replay(context, publisher, first=1)
    assert answers[-1] == [b"", END_OF_REPLAY, b""]
    assert [int.from_bytes(seq, "big") for _, seq, _ in answers[:-1]] == [1, 2]
    assert [decode(payload).events[0] for _, _, payload in answers[:-1]] == [WireRemoved([h], "GPU") for h in (11, 12)]


def test_replay_keeps_only_the_last_buffer_steps_batches(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with publisher_on(context, replay_endpoint="tcp://127.0.0.1:*", buffer_steps=2) as publisher:
        for block_hash in range(5):
            publisher.publish(one_event_batch(block_hash))
        assert publisher.flush(timeout_s=RECEIVE_TIMEOUT_MS / 1000)
        answers = request_replay(context, publisher, first=0)
    assert [int.from_bytes(seq, "big") for _, seq, _ in answers[:-1]] == [3, 4]


def test_a_batch_without_events_is_neither_sent_nor_numbered(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with publisher_on(context, replay_endpoint="tcp://127.0.0.1:*") as publisher:
        publisher.publish(KVEventBatch(ts=1.0, events=()))
        publisher.publish(one_event_batch(5))
        assert publisher.flush(timeout_s=RECEIVE_TIMEOUT_MS / 1000)
        answers = request_replay(context, publisher, first=0)
    assert [(int.from_bytes(seq, "big"), decode(payload).events) for _, seq, payload in answers[:-1]] == [
        (0, [WireRemoved([5], "GPU")])
    ]


def test_the_publisher_fills_in_its_rank_and_keeps_a_batch_own(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with publisher_on(context, replay_endpoint="tcp://127.0.0.1:*", data_parallel_rank=4) as publisher:
        publisher.publish(one_event_batch(1))
        publisher.publish(one_event_batch(2, rank=7))
        assert publisher.flush(timeout_s=RECEIVE_TIMEOUT_MS / 1000)
        answers = request_replay(context, publisher, first=0)
    assert [decode(payload).data_parallel_rank for _, _, payload in answers[:-1]] == [4, 7]


def test_close_sends_every_batch_published_before_it(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    publisher = publisher_on(context)
    sub = subscriber(context, publisher)
    for block_hash in range(50):
        publisher.publish(one_event_batch(block_hash))
    publisher.close()
    received = receive_real(sub, 50)
    sub.close()
    assert [decode(payload).events[0] for _, _, payload in received] == [WireRemoved([h], "GPU") for h in range(50)]


def test_publishing_what_is_not_a_batch_is_a_lifecycle_error(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with publisher_on(context) as publisher:
        with pytest.raises(MalformedEvent, match="expected a KVEventBatch"):
            publisher.publish([BlockRemoved(block_hashes=(1,), medium=MEDIUM_GPU)])  # type: ignore[arg-type]
        assert publisher.flush(1.0) and publisher.send_failures == 0


def test_publish_after_close_is_refused(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    publisher = publisher_on(context)
    publisher.close()
    publisher.close()  # a second close does nothing
    with pytest.raises(TornDown, match="closed"):
        publisher.publish(one_event_batch(1))


def test_a_bind_that_fails_raises_in_the_constructor(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with publisher_on(context) as first:
        with pytest.raises(zmq.ZMQError):
            ZmqEventPublisher(first.endpoint.replace("127.0.0.1", "*"), context=context)


def test_an_ipc_endpoint_is_bound_by_the_publisher(context: zmq.Context[zmq.Socket[bytes]], tmp_path: Path) -> None:
    endpoint = f"ipc://{tmp_path / 'events.sock'}"
    with ZmqEventPublisher(endpoint, context=context) as publisher:
        sub = subscriber(context, publisher)
        publisher.publish(one_event_batch(9))
        ((_, _, payload),) = receive_real(sub, 1)
        sub.close()
    assert publisher.endpoint == endpoint
    assert decode(payload).events == [WireRemoved([9], "GPU")]


@pytest.mark.parametrize("name", ["buffer_steps", "max_queue_size"])
def test_publisher_sizes_must_be_positive_ints(context: zmq.Context[zmq.Socket[bytes]], name: str) -> None:
    sizes: dict[str, Any] = {name: 0}
    with pytest.raises(ConfigError, match=name):
        ZmqEventPublisher("tcp://127.0.0.1:*", context=context, **sizes)


def test_a_batch_that_fails_to_encode_is_counted_and_the_next_one_is_sent(
    context: zmq.Context[zmq.Socket[bytes]], caplog: pytest.LogCaptureFixture,
) -> None:
    unencodable = KVEventBatch(ts=1.0, events=(BlockRemoved(block_hashes=(object(),), medium=MEDIUM_GPU),))  # type: ignore[arg-type]
    with publisher_on(context, replay_endpoint="tcp://127.0.0.1:*") as publisher:
        publisher.publish(unencodable)
        publisher.publish(one_event_batch(6))
        assert publisher.flush(timeout_s=RECEIVE_TIMEOUT_MS / 1000)
        answers = request_replay(context, publisher, first=0)
    assert publisher.send_failures == 1 and "sending batch 0 failed" in caplog.text
    assert [(int.from_bytes(seq, "big"), decode(payload).events) for _, seq, payload in answers[:-1]] == [
        (0, [WireRemoved([6], "GPU")])
    ]


def test_without_msgspec_the_encoding_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from lifecycle import events

    monkeypatch.setitem(sys.modules, "msgspec", None)  # an import of msgspec now fails
    events._wire_structs.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"kv-lifecycle\[events\]"):
            encode_batch(vllm_reference_batch())
    finally:
        events._wire_structs.cache_clear()
