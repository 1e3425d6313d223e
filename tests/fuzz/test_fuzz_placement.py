"""Fuzz the placement inputs a tenant writes: config.pbtxt and CUDA_VISIBLE_DEVICES (exporter.engines.placement).

Oracles: instance_groups returns None or a tuple of InstanceGroup within the bounds for any bytes, and
raises nothing; a config generated in any of the syntaxes protobuf's text format allows (lists or repeated
fields, ``{}`` or ``<>``, separators, comments, strings with escapes, nested messages to skip) gives back
exactly the groups it was built from, and any cut or flipped byte of it gives None or groups, never an
exception.  visible_gpus returns distinct GPUs of the node, at most one per GPU, for any text;
parse_environ raises nothing for any bytes.
"""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from exporter.engines import placement
from exporter.engines.placement import InstanceGroup

UUIDS = tuple(f"GPU-{index:08x}-aaaa-bbbb-cccc-dddddddddddd" for index in range(8))

COMMENT = st.sampled_from(["", " # a comment\n", "\n#\n", "  "])
SEPARATOR = st.sampled_from(["", ",", ";", " "])
STRING = st.text(st.characters(min_codepoint=32, max_codepoint=0x2FF, exclude_characters="\\\"\n"), max_size=12)


@st.composite
def string_literal(draw: st.DrawFn) -> str:
    text = draw(STRING)
    escapes = draw(st.lists(st.sampled_from(["\\n", '\\"', "\\\\", "\\x41", "\\101", "\\'"]), max_size=3))
    return '"' + text + "".join(escapes) + '"'


@st.composite
def skipped_field(draw: st.DrawFn, depth: int = 0) -> str:
    """A field the parser must skip: a scalar, a string, a list, or a nested message (rate_limiter,
    secondary_devices, host_policy and their likes)."""
    name = draw(st.sampled_from(["name", "rate_limiter", "secondary_devices", "host_policy", "profile",
                                 "passive", "resources", "priority", "dims", "x_y"]))
    choices = [st.integers(-(2**31), 2**31 - 1).map(str), string_literal(), st.just("KIND_NVDLA"),
               st.just("true"), st.just("1.5e-3")]
    if depth < 3:
        choices.append(skipped_field(depth + 1).map(lambda inner: "{ " + inner + " # }\n }"))
        choices.append(st.lists(skipped_field(depth + 1).map(lambda inner: "{" + inner + "}"), max_size=3)
                       .map(lambda items: "[" + ", ".join(items) + "]"))
    value = draw(st.one_of(choices))
    colon = ":" if not value.startswith(("{", "[")) else draw(st.sampled_from(["", ":"]))
    return f"{name}{colon} {value}"


GROUP = st.builds(InstanceGroup, st.sampled_from(placement.KINDS), st.integers(0, 8),
                  st.lists(st.integers(0, 15), max_size=5).map(tuple))


@st.composite
def group_text(draw: st.DrawFn, group: InstanceGroup) -> str:
    fields = []
    if group.kind != "KIND_AUTO" or draw(st.booleans()):
        kind = draw(st.sampled_from([group.kind, str(placement.KINDS.index(group.kind))]))
        fields.append(f"kind: {kind}")
    if group.count or draw(st.booleans()):
        fields.append(f"count: {draw(st.sampled_from([str(group.count), hex(group.count)]))}")
    gpu_fields: list[str] = []
    if group.gpus:
        if draw(st.booleans()):
            gpu_fields.append("gpus: [ " + ", ".join(map(str, group.gpus)) + " ]")
        else:
            gpu_fields += [f"gpus: {gpu}" for gpu in group.gpus]
    fields += gpu_fields
    fields += draw(st.lists(skipped_field(), max_size=2))
    fields = draw(st.permutations(fields))
    # kind and count may move, but the gpus keep their order among themselves
    gpus = iter(gpu_fields)
    fields = [next(gpus) if field.startswith("gpus") else field for field in fields]
    opener, closer = draw(st.sampled_from([("{", "}"), ("<", ">")]))
    body = "".join(f"{field}{draw(SEPARATOR)}{draw(COMMENT)} " for field in fields)
    return f"{opener} {body}{closer}"


@st.composite
def config(draw: st.DrawFn) -> tuple[bytes, tuple[InstanceGroup, ...]]:
    groups = draw(st.lists(GROUP, max_size=4))
    parts = draw(st.lists(skipped_field(), max_size=3))
    if groups:
        texts = [draw(group_text(group)) for group in groups]
        if draw(st.booleans()):
            parts.append("instance_group" + draw(st.sampled_from(["", ":"])) + " [ " + ", ".join(texts) + " ]")
        else:
            parts += ["instance_group" + draw(st.sampled_from(["", ":"])) + " " + text for text in texts]
    parts += draw(st.lists(skipped_field(), max_size=2))
    return "".join(f"{part}{draw(SEPARATOR)}{draw(COMMENT)}\n" for part in parts).encode(), tuple(groups)


@given(config())
def test_a_generated_config_gives_back_its_groups(case: tuple[bytes, tuple[InstanceGroup, ...]]) -> None:
    text, groups = case
    assert placement.instance_groups(text) == groups


@given(config(), st.data())
def test_a_damaged_config_gives_none_or_groups(case: tuple[bytes, tuple[InstanceGroup, ...]],
                                               data: st.DataObject) -> None:
    text = case[0]
    if text:
        at = data.draw(st.integers(0, len(text) - 1))
        flipped = text[:at] + bytes([data.draw(st.integers(0, 255))]) + text[at + 1:]
        text = data.draw(st.sampled_from([text[:at], flipped, text[:at] + text[at + 1:]]))
    assert_bounded(placement.instance_groups(text))


def assert_bounded(groups: tuple[InstanceGroup, ...] | None) -> None:
    if groups is not None:
        assert len(groups) <= placement.MAX_GROUPS
        assert sum(len(group.gpus) for group in groups) <= placement.MAX_GPU_ENTRIES
        assert all(group.kind in placement.KINDS for group in groups)
        assert all(0 <= gpu < placement.MAX_ORDINAL for group in groups for gpu in group.gpus)


PUNCTUATION_SOUP = st.lists(st.sampled_from([b"{", b"}", b"[", b"]", b"<", b">", b":", b",", b";", b" ", b"#",
                                             b"\n", b'"', b"'", b"\\", b"instance_group", b"gpus", b"kind",
                                             b"count", b"KIND_GPU", b"0", b"-1", b"0x", b"x"]),
                            max_size=80).map(b"".join)


@given(st.binary(max_size=300) | PUNCTUATION_SOUP)
@example(b"instance_group {" * 40)
@example(b"instance_group [" + b"{}," * 300 + b"{}]")
@example(b"a: '\\")
def test_any_bytes_give_none_or_groups(data: bytes) -> None:
    groups = placement.instance_groups(data)
    assert_bounded(groups)
    placement.config_gpus(groups)


@given(st.text(max_size=80) | st.lists(st.sampled_from(["0", "1", "7", "-1", "", " ", "GPU-0", "GPU-00000001",
                                                        "MIG-a", UUIDS[3], "gpu-", "a"]), max_size=12).map(",".join),
       st.integers(0, len(UUIDS)))
def test_visible_gpus_are_distinct_gpus_of_the_node(value: str, count: int) -> None:
    ordered = UUIDS[:count]
    visible = placement.visible_gpus(value, ordered, {"MIG-a": UUIDS[0]})
    assert len(set(visible)) == len(visible) <= max(count, 1)
    assert set(visible) <= set(ordered) | {UUIDS[0]}


@given(st.binary(max_size=300), st.booleans())
@example(b"CUDA_VISIBLE_DEVICES=\xff\xfe\0", True)
def test_parse_environ_takes_any_bytes(data: bytes, complete: bool) -> None:
    found = placement.parse_environ(data, complete)
    assert found is None or isinstance(found, placement.CudaEnviron)
