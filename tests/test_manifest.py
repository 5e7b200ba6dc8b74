"""The manifest format: canonical bytes, seed compatibility, and refusal of every malformed input."""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import integrity_fs as ifs
from integrity_fs import Manifest, ManifestError

D = hashlib.sha256(b"x").hexdigest()


def doc(**changes: object) -> bytes:
    base: dict[str, object] = {"version": 1, "granularity": "file", "algorithm": "sha256", "files": {"a": D}}
    base.update(changes)
    return json.dumps({k: v for k, v in base.items() if v is not ...}).encode()


def test_seed_example_parses_and_unknown_keys_are_ignored():
    raw = doc(files={"checkpoint_0.pt": D, ".metadata": D}, written_by="someone", extra={"x": 1})
    m = Manifest.from_json(raw)
    assert list(m.files) == [".metadata", "checkpoint_0.pt"] and m.sizes is None


def test_largest_lists_files_by_size_then_name():
    m = Manifest(files={"b": D, "a": D, "c": D, "d": D}, sizes={"b": 5, "a": 5, "c": 9, "d": 1})
    assert m.largest(3) == [("c", 9), ("a", 5), ("b", 5)]
    assert m.largest(10)[-1] == ("d", 1)
    assert Manifest(files={"a": D}).largest(5) == []


def test_canonical_form_is_sorted_indented_utf8_with_newline():
    m = Manifest(files={"b": D, "ä/a": D}, sizes={"b": 1, "ä/a": 2})
    raw = m.to_json()
    assert raw.endswith(b"}\n") and "ä".encode() in raw
    assert raw == Manifest.from_json(raw).to_json()
    assert json.loads(raw) == {
        "algorithm": "sha256",
        "files": {"b": D, "ä/a": D},
        "granularity": "file",
        "sizes": {"b": 1, "ä/a": 2},
        "version": 1,
    }


def test_manifest_is_immutable():
    m = Manifest(files={"a": D})
    with pytest.raises(TypeError):
        m.files["a"] = D  # type: ignore[index]
    with pytest.raises(AttributeError):
        m.version = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "not valid JSON"),
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[]", "must be a JSON object"),
        (b"null", "must be a JSON object"),
        (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
        (doc(version=...), "no 'version'"),
        (doc(files=...), "no 'files'"),
        (doc(algorithm=...), "no 'algorithm'"),
        (doc(granularity=...), "no 'granularity'"),
        (doc(version="1"), "'version' must be an integer"),
        (doc(version=True), "'version' must be an integer"),
        (doc(version=2), "version 2 is not supported"),
        (doc(algorithm=5), "'algorithm' must be a string"),
        (doc(files=[]), "'files' must be an object"),
        (doc(files={"a": 5}), "not a sha256 digest"),
        (doc(files={"a": D.upper()}), "not a sha256 digest"),
        (doc(files={"a": D[:-1]}), "not a sha256 digest"),
        (doc(files={"a": "g" * 64}), "not a sha256 digest"),
        (doc(sizes=[1]), "'sizes' must be an object"),
        (doc(sizes={"b": 1}), "exactly the files"),
        (doc(sizes={"a": -1}), "non-negative integer"),
        (doc(sizes={"a": 1.5}), "non-negative integer"),
        (doc(sizes={"a": "1"}), "non-negative integer"),
        (doc(chunk_size=4), "belong only to chunk granularity"),
        (doc(granularity="chunk", sizes={"a": 1}), "positive integer 'chunk_size'"),
        (doc(granularity="chunk", sizes={"a": 1}, chunk_size=4), "needs 'sizes' and 'chunks'"),
        (doc(granularity="chunk", sizes={"a": 1}, chunk_size=4, chunks={"a": "x"}), "lists of digests"),
        (doc(granularity="chunk", sizes={"a": 9}, chunk_size=4, chunks={"a": [D]}), "call for 3"),
        (doc(granularity="chunk", sizes={"a": 1}, chunk_size=4, chunks={"a": [D]}), "does not match its chunk"),
    ],
)
def test_malformed_manifest_says_what_is_wrong(raw, message):
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(raw)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "/etc/passwd",
        "../outside",
        "a/../../b",
        "a//b",
        "./a",
        "a/.",
        "a\\b",
        "C:/x",
        "a\x00b",
        "a/",
        "_integrity_manifest.json",
    ],
)
@pytest.mark.parametrize("among", [(), ("a", "b/c"), ("a",), ("z",)])
def test_names_that_escape_the_root_are_refused(name, among):
    files = dict.fromkeys([*among[:1], name, *among[1:]], D)  # alone, between, first or last
    with pytest.raises(ManifestError, match="file name|must not list itself"):
        Manifest.from_json(doc(files=files))


_NAME_PARTS = st.sampled_from(["a", "b", ".", "..", "", "/", "\\", "\x00", ":", "C", ".x", "\n", "é"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_NAME_PARTS, max_size=5).map("".join), max_size=4))
def test_names_checked_together_are_refused_exactly_when_one_is(names):
    """``check_names`` (one search over all names) agrees with ``check_name`` on each."""
    from integrity_fs.manifest import check_name, check_names

    def refused(check, value):
        try:
            check(value)
        except ManifestError:
            return True
        return False

    assert refused(check_names, names) == any(refused(check_name, n) for n in names)


def test_nested_manifest_name_is_an_ordinary_file():
    assert Manifest.from_json(doc(files={f"sub/{ifs.MANIFEST_FILENAME}": D})).files


@pytest.mark.parametrize(("field", "value"), [("algorithm", "md5"), ("granularity", "tensor")])
def test_unknown_algorithm_or_granularity_is_not_implemented(field, value):
    with pytest.raises(NotImplementedError, match=value):
        Manifest.from_json(doc(**{field: value}))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"algorithm": "md5"}, NotImplementedError),
        ({"granularity": "tensor"}, NotImplementedError),
        ({"chunk_size": 1024}, ValueError),
        ({"granularity": "chunk", "chunk_size": 0}, ValueError),
        ({"granularity": "chunk", "chunk_size": 1.5}, ValueError),
        ({"max_workers": 0}, ValueError),
    ],
)
def test_bad_seal_options_are_refused_before_anything_is_written(tmp_path, kwargs, error):
    (tmp_path / "a").write_bytes(b"a")
    with pytest.raises(error):
        ifs.seal(tmp_path, **kwargs)
    assert not (tmp_path / ifs.MANIFEST_FILENAME).exists()


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=5000),
    position=st.integers(min_value=0),
    bit=st.integers(min_value=0, max_value=7),
    granularity=st.sampled_from(["file", "chunk"]),
)
def test_any_single_flipped_bit_is_caught(tmp_path_factory, data, position, bit, granularity):
    root = tmp_path_factory.mktemp("flip")
    (root / "shard.bin").write_bytes(data)
    chunk_size = 512 if granularity == "chunk" else None
    ifs.seal(root, granularity=granularity, chunk_size=chunk_size)
    flipped = bytearray(data)
    flipped[position % len(data)] ^= 1 << bit
    (root / "shard.bin").write_bytes(bytes(flipped))
    with pytest.raises(ifs.IntegrityError) as err:
        ifs.verify(root)
    (problem,) = err.value.report.problems
    assert problem.path == "shard.bin" and problem.kind == "mismatch"
    if granularity == "chunk":
        start = (position % len(data)) // 512 * 512
        assert problem.byte_ranges == ((start, min(len(data), start + 512)),)


def test_manifest_pickles_as_itself():
    import pickle

    m = Manifest(files={"a": D}, sizes={"a": 1})
    assert pickle.loads(pickle.dumps(m)) == m


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_canonical_json_is_what_json_dumps_writes(value):
    from integrity_fs.manifest import canonical_json

    assert canonical_json(value) == json.dumps(value, sort_keys=True, indent=2, ensure_ascii=False)
