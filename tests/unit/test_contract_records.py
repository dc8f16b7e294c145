"""The artifact contract's records (runtime/contract/), written by hand as titan-build writes them:
each reads back from its JSON exactly what was written, and refuses what titan-build would not
write with one line that says to rebuild; a program's rank values bind to each rank's
coordinates. (The records of real builds: e2e/test_contract.py.)"""

from __future__ import annotations

import json

import pytest

from conftest import param_spec
from titan.runtime.contract.bindings import Binding, bind_value
from titan.runtime.contract.graph_doc import GraphFormatError
from titan.runtime.contract.hf_record import HFRecord, hf_record
from titan.runtime.contract.layout import Layout
from titan.runtime.contract.manifest import Manifest, ProgramFiles
from titan.runtime.contract.rank_record import Bucket, BufferSpec, GraphInput, RankRecord, bind_program
from titan.runtime.contract.shards import shard_box

SHA = {name: c * 64 for name, c in (("meta", "a"), ("forward", "b"), ("backward", "c"), ("kernel", "d"))}
HF = HFRecord(model_type="llama", architectures=("LlamaForCausalLM",), config={"hidden_size": 256, "tie": False},
              names={"w": "model.w.weight", "norm": "model.norm.weight"}, tied_names={"w": "lm_head.weight"},
              rope_permuted={"w": 32}, stacked={"experts": "model.experts.{i}.weight"})


def _manifest(**changes) -> Manifest:
    """A tp 2 x dp-shard 2 manifest with one program, as titan-build writes it."""
    files = {f"programs/{SHA['meta']}.json": SHA["meta"], f"graphs/{SHA['forward']}.tgraph": SHA["forward"],
             f"graphs/{SHA['backward']}.tgraph": SHA["backward"], f"kernels/{SHA['kernel']}.bin": SHA["kernel"]}
    fields = dict(model="llama3", flavor="debug", model_config={"vocab_size": 2048, "dim": 256},
                  layout=Layout(dp_shard=2, tp=2), world_size=4, batch_size=2, seq_len=128, dtype="float32", ac="none",
                  param_dtype="float32", torch_version="2.13.0+cpu", builder_version="0123456789abcdef",
                  passes=("partition:min_cut", "mask_index_put_to_where"), hf_checkpoint=HF,
                  created="2026-11-25T12:00:00Z", name="llama3-debug-dp-shard2-tp2", cache_key="e" * 32,
                  programs=(ProgramFiles(meta=f"programs/{SHA['meta']}.json", forward=f"graphs/{SHA['forward']}.tgraph",
                                         backward=f"graphs/{SHA['backward']}.tgraph"),),
                  rank_programs=(0, 0, 0, 0), files=files, kernels={"f" * 32: f"kernels/{SHA['kernel']}.bin"})
    return Manifest(**(fields | changes))


def _through_json(doc: dict) -> dict:
    return json.loads(json.dumps(doc))


def test_a_manifest_reads_back_what_was_written():
    manifest = _manifest()
    written = _through_json(manifest.to_json())
    assert Manifest.from_json(written, "art") == manifest
    assert Manifest.from_json(written, "art").to_json() == written
    assert manifest.program_of(3) == manifest.programs[0] and manifest.tokens_per_step == 2 * 128 * 2
    assert Manifest.from_json(_through_json(_manifest(hf_checkpoint=None, kernels={}).to_json()), "art").hf_checkpoint is None


def _edit(doc: dict, path: str | tuple, value) -> dict:
    """`doc` with the value at `path` (keys and list indices, or those joined by '/') replaced;
    DROP deletes it."""
    *parents, last = path.split("/") if isinstance(path, str) else path
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is DROP:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


DROP = object()


@pytest.mark.parametrize("path, value, message", [
    ("format", "zip", "art/manifest.json is not a titan artifact manifest; rebuild with titan-build"),
    ("format_version", 1, "art has artifact format 1; this runtime reads formats 2 to 4: rebuild it"),
    ("format_version", 4, "manifest: format version 4 belongs with a low-precision build's fold_param_casts pass, "
                          "and only with it"),
    ("seq_len", DROP, "art/manifest.json lacks 'seq_len'; rebuild with titan-build"),
    ("world_size", 8, "manifest: mesh [['dp_shard', 2], ['tp', 2]] does not multiply to world size 8"),
    ("mesh", [["tp", 2], ["dp_shard", 2]], "manifest: mesh dimensions out of order"),
    ("mesh/0", ["cp", 2], "manifest: bad mesh dimension ['cp', 2]"),
    # A pipeline without a pp dimension (the other way round: test_pipeline_records.py).
    ("pipeline", {"schedule": {}, "stage_programs": []}, "manifest: 'pipeline' belongs with a pp mesh dimension"),
    ("layout/tp", 4, "manifest: 'layout' disagrees with 'mesh'"),
    (("files", "../../etc/passwd"), SHA["meta"], "manifest files: '../../etc/passwd' is not a plain relative path inside"),
    (("files", f"graphs/{SHA['forward']}.tgraph"), "not-a-digest", "is not a sha256 digest"),
    ("torch_version", "2.13; rm -rf ~", "manifest: torch_version '2.13; rm -rf ~' is not a version string"),
    ("model_config", {"dim": 256}, "manifest: 'model_config' lacks a vocabulary size"),
    ("programs/0/forward", "graphs/other.tgraph", "manifest: program 0 forward file graphs/other.tgraph is not listed"),
    ("rank_programs", [0, 0, 0], "manifest: 'rank_programs' must give a program for each of the 4 ranks"),
    ("rank_programs/3", 1, "manifest rank_programs[3]: expected an integer in [0, 0], got 1"),
    ("kernels", {"not-a-key": f"kernels/{SHA['kernel']}.bin"}, "manifest: kernel key 'not-a-key' is not a kernel key"),
    ("passes", "fuse_exact", "manifest: 'passes' must list pass names"),
    ("name", ["x"], "manifest: name \"['x']\" is not a string"),
    ("hf_checkpoint/rope_permuted/w", 33, "manifest: malformed hf_checkpoint record"),
])
def test_a_manifest_titan_build_would_not_write_is_refused_in_one_line(path, value, message):
    doc = _edit(_through_json(_manifest().to_json()), path, value)
    with pytest.raises(ValueError, match="rebuild") as e:
        Manifest.from_json(doc, "art")
    assert message in str(e.value) and "\n" not in str(e.value)


def _record(**changes) -> RankRecord:
    """Rank 3 of tp 2 x dp-shard 2: two parameters (one cut by both, one padded by FSDP), a
    balancing-bias buffer the forward updates, and one bucket."""
    params = (param_spec("w", [8, 6], [[0, 2, 1], [0, 2, 1]]), param_spec("norm", [5], [[0, 2, 1]]))
    fields = dict(params=params,
                  forward_inputs=(GraphInput(kind="param", fqn="w", cast="bfloat16"),
                                  GraphInput(kind="param", fqn="norm"),
                                  GraphInput(kind="buffer", fqn="bias"), GraphInput(kind="tokens"),
                                  GraphInput(kind="labels")),
                  static_input_indices=(0, 1, 2), saved_activations=3, saved_bytes=4096,
                  backward_outputs=("w", "norm", None, None, None),
                  bucket_plan=(Bucket(graph="forward", kind="all_gather", group="dp_shard", block="layers.0",
                                      params=("w", "norm"), elements=15, dtype="float32", bytes=120),),
                  rank=3, coords=Layout(dp_shard=2, tp=2).coordinates(3), forward_graph=SHA["forward"],
                  backward_graph=SHA["backward"], buffers=(BufferSpec(fqn="bias", shape=(8,), dtype="float32"),),
                  mutated_buffers=("bias",), model_plan={"routed_experts": 8})
    return RankRecord(**(fields | changes))


def test_a_rank_record_reads_back_what_was_written():
    record = _record()
    assert record.params[1].local_shape == (3,)  # 5 rows in 2 parts: chunks of 3, this one padded
    assert RankRecord.from_json(_through_json(record.to_json()), "rank 3") == record
    plain = _record(bucket_plan=(), buffers=(), mutated_buffers=(), model_plan=None, rank=None, coords=None,
                    forward_inputs=_record().forward_inputs[:2] + _record().forward_inputs[3:],
                    static_input_indices=(0, 1), backward_outputs=("w", "norm", None, None))
    assert RankRecord.from_json(_through_json(plain.to_json()), "stored") == plain


@pytest.mark.parametrize("path, value, message", [
    ("forward_inputs/4", {"kind": "tokens"},
     "rank 3: forward inputs must be parameters and buffers plus one tokens and one labels input"),
    ("forward_inputs/0/fqn", "norm", "rank 3: parameter inputs and 'params' name different parameters"),
    ("backward_outputs/1", None, "rank 3: 'backward_outputs' does not match the forward inputs"),
    ("grad_reductions_owed", {"w": "sum"}, "rank 3: this runtime performs no gradient reductions outside the graph"),
    ("static_input_indices/0", 5, "rank 3 static_input_indices: expected an integer in [0, 4], got 5"),
    ("params/0/local_shape", [4, 6], "rank 3 parameter w: slices of [8, 6] give [2, 6], not local_shape [4, 6]"),
    ("params/0/slices/0/2", 2, "rank 3 parameter w: expected an integer in [0, 1], got 2"),
    ("params/1/init", {"kind": "uniform"}, "rank 3 parameter norm: unknown init {'kind': 'uniform'}"),
    ("params/1/init", {"kind": "normal", "std": 1e9}, "rank 3 parameter norm: init std out of range"),
    ("params/1/init", {"kind": "normal", "std": float("inf")}, "rank 3 parameter norm: init std is not a finite number"),
    ("params/1/init", {"kind": "trunc_normal", "std": 0.02, "a": 2, "b": -2},
     "rank 3 parameter norm: trunc_normal needs a < b"),
    ("buffers/0/dtype", "float16", "rank 3 buffer bias: unknown dtype 'float16' or metric 'None'"),
    ("mutated_buffers", ["bias", "bias"], "rank 3: 'mutated_buffers' must name distinct buffers of 'buffers'"),
    ("coords", {"tp": "1"}, "rank 3: coordinates {'tp': '1'} are not a mesh place"),
    ("bucket_plan/0/elements", -1, "rank 3 bucket plan: expected an integer in [0, 17179869184], got -1"),
    # A copy in place of a parameter (runtime/param_copies.py): of a float32 parameter only, in a
    # compute dtype only.
    ("forward_inputs/2/cast", "bfloat16",
     "rank 3: forward input 'bias': only a parameter is taken as a copy, in bfloat16 or float16"),
    ("forward_inputs/1/cast", "int8", "rank 3: forward input 'norm': only a parameter is taken as a copy, in "
                                      "bfloat16 or float16"),
    ("params/0/dtype", "bfloat16", "rank 3: only a float32 parameter is taken as a lower-precision copy"),
])
def test_a_rank_record_titan_build_would_not_write_is_refused_in_one_line(path, value, message):
    doc = _edit(_through_json(_record().to_json()), path, value)
    with pytest.raises(ValueError) as e:
        RankRecord.from_json(doc, "rank 3")
    assert str(e.value) == f"{message}; rebuild the artifact with titan-build"


def _stored_program() -> dict:
    """The record as a program stores it: no rank, each slice naming the mesh dimension that cuts it."""
    doc = _through_json(_record(rank=None, coords=None).to_json())
    doc["params"][0]["slices"] = [[0, 2, "tp"], [0, 2, "dp_shard"]]
    doc["params"][1]["slices"] = [[0, 2, "dp_shard"]]
    return doc


@pytest.mark.parametrize("rank", range(4))
def test_a_stored_program_binds_each_rank_to_its_own_slices(rank):
    layout = Layout(dp_shard=2, tp=2)
    bound = bind_program(_stored_program(), rank=rank, layout=layout, where=f"rank {rank}", what="program")
    coords = layout.coordinates(rank)
    assert (bound.rank, bound.coords) == (rank, coords)
    assert [p.slices for p in bound.params] == [((0, 2, coords["tp"]), (0, 2, coords["dp_shard"])),
                                                ((0, 2, coords["dp_shard"]),)]
    # Rank 3's binding is the record traced for rank 3.
    if rank == 3:
        assert bound == _record()
    assert bound.params[0].local_shape == shard_box([list(s) for s in bound.params[0].slices], [8, 6]).local_shape


@pytest.mark.parametrize("layout, message", [
    (Layout(dp_shard=2, tp=4), "slice [0, 2, 'tp'] does not cut tp into its 4 coordinates"),
    (Layout(dp_shard=4), "slice [0, 2, 'tp'] is not cut by a sharded mesh dimension of this layout"),
])
def test_a_program_whose_slices_do_not_fit_the_layout_is_refused(layout, message):
    with pytest.raises(ValueError, match="rebuild with titan-build") as e:
        bind_program(_stored_program(), rank=1, layout=layout, where="program", what="program")
    assert message in str(e.value)


def test_the_hugging_face_record_reads_back_and_names_each_tensor():
    assert HFRecord.from_json(_through_json(HF.to_json()), "test") == HF
    assert HF.hf_names("experts", 3) == ["model.experts.0.weight", "model.experts.1.weight", "model.experts.2.weight"]
    assert HF.hf_names("w", 8) == ["model.w.weight"]
    with pytest.raises(ValueError, match="checkpoint: this model has no Hugging Face counterpart"):
        hf_record({"hf_checkpoint": None}, "checkpoint")


@pytest.mark.parametrize("path, value", [
    ("stacked/experts", "model.experts.weight"),  # no place for the expert index
    ("stacked/w", "model.w.{i}"),                 # also named whole
    ("rope_permuted/w", 0),
    ("config/hidden_size", ["256"]),  # a list holds layer numbers only
    ("architectures", "LlamaForCausalLM"),
    ("names/w", 7),
])
def test_a_malformed_hugging_face_record_is_refused(path, value):
    with pytest.raises(ValueError, match="^manifest: malformed hf_checkpoint record; rebuild the artifact with titan-build$"):
        HFRecord.from_json(_edit(_through_json(HF.to_json()), path, value), "manifest")


def test_a_binding_is_affine_in_the_rank_coordinates_and_bounded():
    binding = Binding.from_json({"base": 5, "coef": {"tp": 1000, "dp_shard": -3}}, "node 4")
    assert binding.value({"tp": 2, "dp_shard": 1}, "node 4") == 5 + 2000 - 3
    assert bind_value(binding.to_json(), {"tp": 1, "dp_shard": 0, "dp_replicate": 1}, "node 4") == 1005
    for spec, coords, message in (
            (binding.to_json(), None, "node 4: the graph binds rank coordinates; load it for a rank"),
            (binding.to_json(), {"tp": 1}, "node 4: binding on 'dp_shard', which is not a mesh dimension here (tp)"),
            ({"base": 1}, {"tp": 1}, "node 4: malformed binding {'base': 1}"),
            ({"base": 1 << 50, "coef": {}}, {}, f"node 4: binding term {1 << 50} is not an integer within bounds"),
            ({"base": 0, "coef": {"tp": True}}, {"tp": 1}, "node 4: binding term True is not an integer within bounds"),
            ({"base": 1 << 33, "coef": {"tp": 1 << 33}}, {"tp": 3},
             f"node 4: binding term {1 << 35} is not an integer within bounds")):
        with pytest.raises(GraphFormatError) as e:
            bind_value(spec, coords, "node 4")
        assert str(e.value) == message


def test_mfu_counts_from_the_config_and_declines_sizes_it_cannot_trust():
    from titan.runtime.mfu import flops_per_token, mfu_text
    params = (param_spec("layers.0.w", [256, 256], []),
              param_spec("tok_embeddings.weight", [2048, 256], []))
    plain = _manifest(model_config={"vocab_size": 2048, "dim": 256, "n_layers": 2}, dtype="bfloat16")
    assert flops_per_token(plain, params) == 6 * 256 * 256 + 12 * 2 * 256 * 128
    assert mfu_text(plain, params, tokens_per_s=1e6, device_name="NVIDIA H100 80GB HBM3").startswith("MFU ")
    for hostile in ({"dim": [1, 2]}, {"dim": True}, {"dim": -1}, {"n_layers": "2"}, {"n_layers": None}):
        m = _manifest(model_config={"vocab_size": 2048, "dim": 256, "n_layers": 2} | hostile, dtype="bfloat16")
        assert flops_per_token(m, params) is None
        assert mfu_text(m, params, tokens_per_s=1e6, device_name="NVIDIA H100 80GB HBM3") == ""


def _bounded(drop: bool = False) -> dict:
    """A manifest with a bounded MoE dispatch (format 3), its redo program the same files."""
    doc = _through_json(_manifest().to_json())
    doc.update(format_version=3, moe_capacity={"factor": 1.25, "drop": drop})
    if not drop:
        doc.update(redo_programs=doc["programs"], redo_rank_programs=doc["rank_programs"])
    return doc


def test_a_bounded_moe_manifest_reads_back_with_its_redo_programs():
    manifest = Manifest.from_json(_bounded(), "art")
    assert manifest.moe_capacity.factor == 1.25 and not manifest.moe_capacity.drop
    assert manifest.redo_program_of(3) == manifest.programs[0]
    assert manifest.to_json() == _bounded()
    dropping = Manifest.from_json(_bounded(drop=True), "art")
    assert dropping.moe_capacity.drop and dropping.redo_programs == ()
    assert _through_json(_manifest().to_json())["format_version"] == 2  # every other artifact stays format 2


def test_a_manifest_whose_programs_take_parameter_copies_is_format_4_with_or_without_a_moe_capacity():
    """A runtime from before the copies (runtime/param_copies.py) reads formats 2 and 3 only: it
    refuses these in one line instead of passing fp32 parameters to a bf16 graph."""
    copies = _manifest(dtype="bfloat16", passes=("partition:min_cut", "fold_param_casts"))
    doc = _through_json(copies.to_json())
    assert doc["format_version"] == 4 and Manifest.from_json(doc, "art") == copies
    assert _through_json(_manifest(dtype="float32", passes=copies.passes).to_json())["format_version"] == 2
    bounded = _bounded() | {"format_version": 4, "dtype": "bfloat16", "passes": list(copies.passes)}
    assert Manifest.from_json(bounded, "art").to_json() == bounded
    with pytest.raises(ValueError, match="format version 4 belongs with a low-precision build's fold_param_casts"):
        Manifest.from_json(doc | {"format_version": 2}, "art")


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(format_version=2), "'moe_capacity' belongs with format version 3"),
    (lambda d: d.pop("moe_capacity"), "'moe_capacity' belongs with format version 3"),
    (lambda d: d.update(moe_capacity={"factor": -1, "drop": False}), "'moe_capacity' must hold a positive 'factor'"),
    (lambda d: d.update(moe_capacity={"factor": 1.25, "drop": "no"}), "'moe_capacity' must hold a positive 'factor'"),
    (lambda d: d.update(moe_capacity={"factor": 1.25, "drop": True}), "a drop-and-pad 'moe_capacity' has no 'redo_programs'"),
    (lambda d: d.pop("redo_programs"), "'redo_programs' must list between 1 and 4 programs"),
    (lambda d: d.update(redo_rank_programs=[0, 0]), "'redo_rank_programs' must give a program for each of the 4 ranks"),
    (lambda d: _edit(d, "redo_programs/0/meta", "programs/other.json"), "program 0 meta file programs/other.json is "
                                                                        "not listed"),
])
def test_a_bounded_moe_manifest_titan_build_would_not_write_is_refused(edit, message):
    doc = _bounded()
    edit(doc)
    with pytest.raises(ValueError, match="rebuild") as e:
        Manifest.from_json(doc, "art")
    assert message in str(e.value) and "\n" not in str(e.value)
