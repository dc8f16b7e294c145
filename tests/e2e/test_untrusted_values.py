"""Every value read from an artifact, a checkpoint, a metrics file or a tokenizer is checked where
it is read (issue 29): a crafted value is one `error:` line, never a traceback, never a call into
torch with it. Artifacts are crafted as an attacker would: every digest made consistent."""

from __future__ import annotations

import hashlib
import json
import os
import pty
import shutil
import subprocess
import sys

import msgpack
import pytest
import torch

from conftest import titan
from titan.runtime.contract.artifact import open_artifact
from titan.runtime.contract.checks import ArtifactError
from titan.runtime.contract.graph_decode import load_graph, region_kinds
from titan.runtime.contract.graph_doc import GraphFormatError
from titan.runtime.contract.hf_record import MAX_CONFIG_LIST
from titan.runtime.contract.manifest import Manifest
from titan.runtime.contract.node_fields import check_node_fields
from titan.runtime.contract.rank_record import RankRecord, check_graphs


def craft(src, dst, *, meta=None, forward=None, manifest=None):
    """A copy of artifact `src` at `dst` with program 0's metadata, forward graph document and/or
    manifest changed, and every digest that covers them made consistent again."""
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    program = m["programs"][0]
    md = json.loads((dst / program["meta"]).read_text())
    if forward:
        doc = msgpack.unpackb((dst / program["forward"]).read_bytes(), raw=False)
        forward(doc)
        data = msgpack.packb(doc, use_bin_type=True)
        (dst / program["forward"]).write_bytes(data)
        m["files"][program["forward"]] = md["forward_graph"] = hashlib.sha256(data).hexdigest()
    if meta:
        meta(md)
    data = json.dumps(md).encode()
    (dst / program["meta"]).write_bytes(data)
    m["files"][program["meta"]] = hashlib.sha256(data).hexdigest()
    if manifest:
        manifest(m)
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def _one_error_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and lines and all(line.startswith("error: ") for line in lines), r.stderr
    assert "Traceback" not in r.stderr
    return lines[-1]


def _forward_doc(art) -> dict:
    a = open_artifact(art)
    return msgpack.unpackb(a.read_verified(a.manifest.programs[0].forward), raw=False)


def _first_call(doc) -> int:
    return next(i for i, n in enumerate(doc["nodes"]) if n["op"] == "call_function")


def _set_val(where: str, **fields):
    def change(doc):
        node = doc["nodes"][0 if where == "input" else _first_call(doc)]
        node["val"].update(fields)
    return change


def _replace_val(value):
    def change(doc):
        doc["nodes"][_first_call(doc)]["val"] = value
    return change


def _constant_named(name: str):
    import safetensors.torch

    def change(doc):
        doc["nodes"].insert(_first_call(doc), {"name": "c", "op": "get_attr", "target": name})
        doc["constants"] = safetensors.torch.save({name: torch.zeros(2)})
    return change


def _literal_group(doc):
    """The first collective names its group by the real name a rank binds ('0') instead of a mesh dimension."""
    for n in doc["nodes"]:
        for i, a in enumerate(n.get("args", [])):
            if isinstance(a, dict) and "$group" in a:
                n["args"][i] = "0"
                return
    raise AssertionError("no collective")


def _reduce_op(doc):
    for n in doc["nodes"]:
        if n.get("target", "").startswith("_c10d_functional.reduce_scatter"):
            n["args"][1] = "nope"
            return
    raise AssertionError("no reduce-scatter")


GRAPH_CASES = {
    # name: (layout, change, words of the error); "printable": titan-show's reader refuses it too
    "val dtype 'load' on a result": ("single", _set_val("call", dtype="load"), "dtype 'load' is not one of"),
    "val dtype 'load' on an input": ("single", _set_val("input", dtype="load"), "dtype 'load' is not one of"),
    "val shape with a string": ("single", _set_val("call", shape=["x"]), "shape ['x'] is not a list"),
    "val shape negative": ("single", _set_val("call", shape=[-1, 2], stride=[2, 1]), "shape [-1, 2] is not"),
    "val shape of 2^40 elements": ("single", _set_val("call", shape=[1 << 20, 1 << 20], stride=[1 << 20, 1]),
                                   "over the bound of 8,589,934,592 for one node's output"),
    "val shape not a list": ("single", _set_val("call", shape=5), "shape 5 is not a list"),
    "val stride of another rank": ("single", lambda doc: doc["nodes"][_first_call(doc)]["val"]["stride"].append(1),
                                   "different lengths"),
    "val huge integer": ("single", _replace_val({"int": 1 << 40}), "not an integer within 2^34"),
    "val a string": ("single", _replace_val("tensor"), "is not a tensor, an integer"),
    "get_attr 'training'": ("single", _constant_named("training"), "names an attribute of a module"),
    "get_attr 'forward'": ("single", _constant_named("forward"), "names an attribute of a module"),
    "get_attr '_buffers'": ("single", _constant_named("_buffers"), "names an attribute of a module"),
    "literal process group": ("tp2", _literal_group, "a literal process group '0'"),
    "unknown reduce op": ("tp2", _reduce_op, "'nope' is not one of"),
}
PRINTABLE = {k for k in GRAPH_CASES if k.startswith("val")}


@pytest.fixture(scope="module")
def arts(debug_artifact):
    return {"single": debug_artifact(), "tp2": debug_artifact(tp=2)}


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_crafted_graph_values_are_refused_by_the_loader_and_the_tools(arts, case):
    layout, change, words = GRAPH_CASES[case]
    doc = _forward_doc(arts[layout])
    change(doc)
    coords = {"tp": 0} if layout == "tp2" else {}
    with pytest.raises(GraphFormatError, match=words.replace("[", r"\[").replace("]", r"\]").replace("^", r"\^")):
        load_graph(msgpack.packb(doc, use_bin_type=True), device=torch.device("cpu"),
                   groups={"tp": "0"} if layout == "tp2" else {}, coords=coords,
                   regions=region_kinds(open_artifact(arts[layout]).manifest.passes))
    if case in PRINTABLE:
        with pytest.raises(GraphFormatError):
            check_node_fields(doc)


@pytest.mark.parametrize("command", ["run", "show", "diff"])
def test_a_crafted_node_value_is_one_error_line_in_every_command(arts, tmp_path, command):
    art = craft(arts["single"], tmp_path / "art", forward=_set_val("call", dtype="load"))
    args = {"run": (art, "--steps", 1), "show": (art,), "diff": (arts["single"], art)}[command]
    assert "dtype 'load' is not one of" in _one_error_line(titan(command, *args))


def _program(art):
    a = open_artifact(art)
    return a, json.loads(a.read_verified(a.manifest.programs[0].meta))


@pytest.mark.parametrize("dtype", ["load", "float8", 7])
def test_a_parameter_dtype_off_the_allow_list_is_refused_where_it_is_read(arts, dtype):
    _, md = _program(arts["single"])
    md["params"][0]["dtype"] = dtype
    md.update(rank=0, coords={})
    with pytest.raises(ArtifactError, match="is not one of float32, bfloat16"):
        RankRecord.from_json(md, "rank 0")


@pytest.mark.parametrize("layout", ["single", "tp2"])
@pytest.mark.parametrize("change, words", [
    (dict(seq_len=64), "batch of 2 x 64 tokens is not what the forward graph's tokens input takes"),
    (dict(batch_size=3), "batch of 3 x 128 tokens"),
    (dict(vocab=4096), "vocabulary of 4096 tokens is not the 2048 rows of the embedding tok_embeddings.weight"),
])
def test_batch_shape_and_vocabulary_that_disagree_with_the_graphs_are_refused(arts, layout, change, words):
    a = open_artifact(arts[layout])
    m = a.manifest
    bind = dict(groups={"tp": "0"}, coords=a.rank_coordinates(0), device=torch.device("cpu"),
                regions=region_kinds(m.passes))
    forward = load_graph(a.read_verified(a.rank_entry(0).forward), **bind)
    backward = load_graph(a.read_verified(a.rank_entry(0).backward), **bind)
    kwargs = dict(rank=0, layout=a.layout, graph_hashes={k: a.graph_hash(0, k) for k in ("forward", "backward")})
    check_graphs(a.rank_record(0), forward, backward, "rank 0", batch_shape=(m.batch_size, m.seq_len),
                 vocab_size=m.vocab_size, **kwargs)  # as built: accepted
    with pytest.raises(ArtifactError, match=words):
        check_graphs(a.rank_record(0), forward, backward, "rank 0",
                     batch_shape=(change.get("batch_size", m.batch_size), change.get("seq_len", m.seq_len)),
                     vocab_size=change.get("vocab", m.vocab_size), **kwargs)


def test_a_manifest_whose_vocabulary_disagrees_with_the_graphs_is_one_line_from_titan_run(arts, tmp_path):
    art = craft(arts["single"], tmp_path / "art", manifest=lambda m: m["model_config"].update(vocab_size=4096))
    assert "vocabulary of 4096 tokens is not the 2048 rows" in _one_error_line(titan("run", art, "--steps", 1))


@pytest.mark.parametrize("value", [[[1, 2]], ["a"], [True], list(range(MAX_CONFIG_LIST + 1)), {"a": 1}, "x" * 300])
def test_model_config_values_must_be_plain(arts, value):
    """Plain: numbers, short strings, bounded lists of layer numbers (Qwen3's mlp_only_layers)."""
    m = json.loads((arts["single"] / "manifest.json").read_text())
    m["model_config"]["dim"] = value
    with pytest.raises(ArtifactError, match="model_config"):
        Manifest.from_json(m, arts["single"])


@pytest.fixture(scope="module")
def checkpoint(debug_artifact, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    r = titan("run", debug_artifact(), "--steps", 0, "--checkpoint-dir", root / "ck")
    assert r.returncode == 0, r.stderr
    return root / "ck"


@pytest.mark.parametrize("field, value, words", [
    ("params", [1 << 20, 1 << 20], "has shape [1048576, 1048576], not at most 8 dimensions"),
    ("params", [2048, "x"], "has shape"),
    ("params", [-1, 256], "has shape"),
    ("params", "abc", "has shape"),
    ("step", 2 ** 60, "step '1152921504606846976' is not an integer"),
    ("optimizer_steps", "1", "optimizer_steps '1' is not an integer"),
    ("seq_len", None, "seq_len 'None' is not an integer"),
    ("hf_config", [1], "hf_config is not a map"),
])
def test_checkpoint_description_values_are_checked_where_read(checkpoint, tmp_path, field, value, words):
    from titan.runtime.checkpoint import read_state

    ck = tmp_path / "ck"
    shutil.copytree(checkpoint, ck)
    (step,) = ck.iterdir()
    d = json.loads((step / "titan.json").read_text())
    if field == "params":
        d["params"]["tok_embeddings.weight"] = value
    else:
        d[field] = value
    (step / "titan.json").write_text(json.dumps(d))
    with pytest.raises(ValueError) as e:
        read_state(step)
    assert words in str(e.value) and "use another checkpoint" in str(e.value)
    if field == "params" and value == [1 << 20, 1 << 20]:  # and titan-export says so in one line, allocating nothing
        assert words in _one_error_line(titan("export", ck, "--hf", tmp_path / "hf"))


METRIC_LINE = {"step": 1, "loss": 2.5, "tokens_per_s": 100.0, "step_time_s": 0.1}


@pytest.mark.parametrize("change, words", [
    (dict(loss="1" + "0" * 400), "loss"),           # as a JSON number: an int no float holds
    (dict(loss="2.5"), "loss is '2.5', not a number"),
    (dict(loss=True), "loss is 'True', not a number"),
    (dict(tokens_per_s=float("inf")), "tokens_per_s is inf, not a finite number"),
    (dict(step_time_s=float("nan")), "step_time_s is nan"),
    (dict(step_time_s=-1), "step_time_s is -1.0"),
    (dict(peak_mem_gib="x"), "peak_mem_gib is 'x', not a number"),
    (dict(step=1.5), "step '1.5' is not an integer"),
    (dict(step=-5), "step '-5' is not an integer"),
    (dict(step=1 << 60), "is not an integer in [0, 2^53]"),
])
def test_metrics_values_are_checked_where_read(tmp_path, change, words):
    from titan.runtime.metrics_file import read_metrics

    rec = dict(METRIC_LINE, **change)
    line = json.dumps(rec)
    if isinstance(change.get("loss"), str) and change["loss"].startswith("1000"):
        line = line.replace(f'"{change["loss"]}"', change["loss"])
    path = tmp_path / "m.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError) as e:
        read_metrics(path)
    assert "line 1" in str(e.value) and words in str(e.value), str(e.value)


def test_a_diverged_runs_nan_loss_is_reported_and_a_huge_value_is_one_line(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(dict(METRIC_LINE, loss=float("nan"))) + "\n" + json.dumps(dict(METRIC_LINE, step=2)) + "\n")
    r = titan("report", path, "--summary")
    assert r.returncode == 0 and "first nan" in r.stdout, r.stderr
    path.write_text(json.dumps(METRIC_LINE).replace("2.5", "1" + "0" * 400) + "\n")
    assert "loss" in _one_error_line(titan("report", path, "--summary"))


def test_report_and_metrics_rewrite_never_write_through_a_planted_link(tmp_path):
    """The old temp names (.<name>.tmp) were predictable and opened through links."""
    pytest.importorskip("matplotlib")
    from titan.runtime.step_log import keep_steps_through

    victim = tmp_path / "victim"
    victim.write_text("keep me")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("".join(json.dumps(dict(METRIC_LINE, step=s)) + "\n" for s in (1, 2, 3)))
    for name in (".m.jsonl.tmp", ".report.png.tmp"):
        (tmp_path / name).symlink_to(victim)
    keep_steps_through(str(metrics), 2)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2]
    r = titan("report", metrics, "-o", tmp_path / "report.png")
    assert r.returncode == 0, r.stderr
    assert victim.read_text() == "keep me" and (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == [".m.jsonl.tmp",
                                                                                         ".report.png.tmp"]


def _tokenizer(path, *, vocab: dict, post=None):
    path.write_text(json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": post, "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}))
    return path


@pytest.mark.parametrize("kind", ["panics", "raises"])
def test_a_tokenizer_that_fails_inside_its_library_is_one_line(tmp_path, kind):
    pytest.importorskip("tokenizers")
    if kind == "panics":  # a post-processor naming a token the tokenizer lacks: a Rust panic (BaseException)
        tok = _tokenizer(tmp_path / "tok.json", vocab={"a": 0, "[UNK]": 1}, post={
            "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "[CLS]", "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {}})
    else:  # no unknown token in the vocabulary: a plain Exception from the library
        tok = _tokenizer(tmp_path / "tok.json", vocab={"a": 0})
    (tmp_path / "t.txt").write_text("a b c\n")
    r = subprocess.run([sys.executable, "-m", "titan.cli.data", str(tmp_path / "t.txt"), "-o", str(tmp_path / "o.bin"),
                        "--tokenizer", str(tok)], capture_output=True, text=True, env=dict(os.environ, RUST_BACKTRACE="1"))
    line = _one_error_line(r)
    assert "failed while encoding text" in line and "panicked" not in r.stderr
    assert not (tmp_path / "o.bin").exists()


def _through_a_terminal(*argv) -> bytes:
    """What a command writes to a terminal (a pty: click strips CSI sequences from pipes only)."""
    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", *map(str, argv)], stdout=follower, stderr=follower)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # the command ended and closed its side
            break
        if not chunk:
            break
        out += chunk
    p.wait()
    os.close(leader)
    return out


HOSTILE_NAME = "tok\x1b]2;owned\x07\x1b[2J\u202eRED\r"


def test_artifact_strings_reach_the_terminal_escaped(arts, tmp_path):
    def rename(md):
        md["params"][0]["fqn"] = md["forward_inputs"][0]["fqn"] = md["backward_outputs"][0] = HOSTILE_NAME
    art = craft(arts["single"], tmp_path / "art", meta=rename)
    for argv in (("titan.cli.show", art), ("titan.cli.diff", arts["single"], art)):
        out = _through_a_terminal(*argv)
        assert b"\\x1b]2;owned\\x07\\x1b[2J\\u202eRED" in out, out[-2000:]
        assert b"\x1b" not in out and "\u202e".encode() not in out and b"\x07" not in out


def test_escape_controls_keeps_newlines_and_tabs_and_escapes_the_rest():
    from titan.runtime.common.terminal import escape_controls

    assert escape_controls("a\tb\nc") == "a\tb\nc"
    assert escape_controls("\x1b[31m\x9b\x00\u2066x\ufeff") == "\\x1b[31m\\x9b\\x00\\u2066x\\ufeff"
