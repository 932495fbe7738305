"""Bring your own decoder: the mistakes a user's adapter typically makes are named before any graph is
built, and torch.onnx's own failures are quoted by their cause."""

from __future__ import annotations

import dataclasses
import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import replayed_export

from exporter.artifact.consumers import ModelSizes, genai_config, hf_config
from exporter.artifact.folder import Artifact
from exporter.artifact.manifest import read_manifest
from exporter.cli.export_report import format_inspect
from exporter.errors import ExportFailed, InputError
from exporter.export import pipeline as export_module
from exporter.export import tracing
from exporter.export.pipeline import export_artifact
from exporter.runtime.runner import OrtRunner
from exporter.verify.engine import verify_artifact
from exporter.verify.inputs import ParitySettings, prefill_feeds, prompt_batch
from exporter.verify.reports import format_verify
from reference import CausalLMOutput, DecoderSpec, check_adapter
from reference.checkpoints import load_checkpoint
from reference.errors import CheckpointError, ConfigError, ModelError
from reference.layers import shifted_cross_entropy

IDS = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(0))


def _adapter(byo_example, **spec_fields):
    model = byo_example.demo_model()
    adapter = byo_example.SeedDemoAdapter(model)
    adapter.config = dataclasses.replace(adapter.config, **spec_fields)
    return model, adapter


def _tuple_forward(adapter):
    forward = adapter.forward
    adapter.forward = lambda *a, **kw: (lambda out: (out.logits, out.past_key_values))(forward(*a, **kw))
    return adapter


@pytest.mark.parametrize(
    "spec_fields, message",
    [
        ({"num_hidden_layers": 3}, r"past_key_values holds 2 layers, but num_hidden_layers is 3"),
        ({"num_hidden_layers": 1}, r"past_key_values holds 2 layers, but num_hidden_layers is 1"),
        ({"num_key_value_heads": 2}, r"layer 0's \(k, v\) have shapes .*\(2, \d, 4, 16\).* = \(2, \d, 2, 16\)"),
        ({"vocab_size": 200}, r"logits have shape \(2, \d, 256\), not .* \(2, \d, 200\)"),
    ],
    ids=["too many layers", "too few layers", "wrong kv heads", "wrong vocab"],
)
def test_a_config_the_model_does_not_have_is_named_by_check_adapter_and_by_the_export(
    byo_example, tmp_path, spec_fields, message
):
    # The export's graph lint saw a missing layer only as outputs out of place ("loss has rank 4").
    model, adapter = _adapter(byo_example, **spec_fields)
    with pytest.raises(ModelError, match=message):
        check_adapter(adapter, lambda x: model(x)[0], IDS)
    with pytest.raises(ExportFailed, match="the model's forward breaks the contract .*" + message):
        export_artifact(adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_forward_returning_a_tuple_is_named(byo_example, tmp_path):
    model, adapter = _adapter(byo_example)
    _tuple_forward(adapter)
    with pytest.raises(ModelError, match="forward returned a tuple, not a CausalLMOutput"):
        check_adapter(adapter, lambda x: model(x)[0], IDS)
    with pytest.raises(ExportFailed, match="forward returned a tuple, not a CausalLMOutput"):
        export_artifact(adapter, tmp_path / "out")


@pytest.mark.parametrize("transposed", ["kv", "k", "v"])
def test_a_cache_in_the_models_own_heads_first_layout_is_named(byo_example, transposed):
    model, adapter = _adapter(byo_example)
    forward = adapter.forward

    def heads_first(*a, **kw):  # (B, Hkv, L, D): consistent with itself, so cached decoding alone agrees
        out = forward(*a, **kw)
        return dataclasses.replace(
            out,
            past_key_values=[
                (k.transpose(1, 2) if "k" in transposed else k, v.transpose(1, 2) if "v" in transposed else v)
                for k, v in out.past_key_values
            ],
        )

    adapter.forward = heads_first
    with pytest.raises(ModelError, match=r"not \(batch, length, num_key_value_heads, head_dim\)"):
        check_adapter(adapter, lambda x: model(x)[0], IDS[:, :1])


def test_a_present_without_the_past_is_named_before_tracing(byo_example, tmp_path, monkeypatch):
    # Named before tracing, with the cache and the fix, not after both traces as "symbol 'sequence_length' stands
    # for both sequence_length and total_sequence_length".
    model, adapter = _adapter(byo_example)
    forward = adapter.forward

    def new_positions_only(input_ids, past_key_values=None, **kw):
        out = forward(input_ids, past_key_values=past_key_values, **kw)
        if past_key_values is None:
            return out
        new = input_ids.shape[1]
        return dataclasses.replace(out, past_key_values=[(k[:, -new:], v[:, -new:]) for k, v in out.past_key_values])

    adapter.forward = new_positions_only
    monkeypatch.setattr(tracing, "_torch_export", lambda *a: pytest.fail("traced before the check"))
    with pytest.raises(
        ExportFailed,
        match=r"layer 0's present \(k, v\) hold the 1 new positions only, not the 3 "
        r"past ones before them: return the past concatenated",
    ):
        export_artifact(adapter, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_check_adapter_leaves_each_modules_mode_as_it_found_it(byo_example):
    model, adapter = _adapter(byo_example)
    assert adapter.training and not model.training  # a new adapter is in training mode around an eval model
    assert check_adapter(adapter, lambda x: model(x)[0], IDS)
    assert adapter.training and not model.training
    model.train()  # mid-training: dropout must stay on afterwards
    assert check_adapter(adapter, lambda x: model(x)[0], IDS)
    assert all(m.training for m in model.modules())


def test_an_unexportable_forward_is_reported_by_its_cause(byo_example, tmp_path):
    # torch.onnx's own first line ("Failed to export the model with torch.export. \x1b[96mThis is step
    # 1/3\x1b[0m of exporting the model to ONNX. Next steps:") names neither the branch nor the fix: the error must.
    model, adapter = _adapter(byo_example)
    forward = adapter.forward

    def skips_an_unpadded_mask(input_ids, attention_mask=None, **kw):
        if attention_mask is not None and bool((attention_mask == 1).all()):  # a branch on tensor values
            attention_mask = None
        return forward(input_ids, attention_mask=attention_mask, **kw)

    adapter.forward = skips_an_unpadded_mask
    with pytest.raises(ExportFailed) as caught:
        export_artifact(adapter, tmp_path / "out")
    message = str(caught.value)
    assert message.startswith("torch.onnx could not export prefill.onnx and decode.onnx: GuardOnDataDependentSymNode: ")
    assert "data-dependent" in message and "\x1b" not in message and "Next steps" not in message
    # torch names the user's line only far down its message; the one line ends with it.
    assert re.search(
        r", raised by \S*test_byo\.py:\d+ in skips_an_unpadded_mask: `if attention_mask is not None "
        r"and bool\(\(attention_mask == 1\)\.all\(\)\):  # a branch on tensor values`$",
        message,
    ), message


def test_a_checkpoint_of_another_design_points_to_bring_your_own(byo_example, tmp_path):
    # The seed demo's state dict has MiniMind's key names but a fused qkv: no preset or --config can load it.
    torch.save(byo_example.demo_model().state_dict(), tmp_path / "demo.pth")
    with pytest.raises(CheckpointError, match=r"cannot infer the minimind config.*reference/byo\.py"):
        load_checkpoint(tmp_path / "demo.pth")


def _boolean_mask_adapter(byo_example):
    """The seed demo model attending through F.scaled_dot_product_attention with a boolean mask: a
    left-padded query has no real key at or before it, so its row of the mask is all False and its output
    is whatever each runtime makes of an empty softmax."""

    class BooleanMaskAdapter(byo_example.SeedDemoAdapter):
        def forward(
            self,
            input_ids,
            attention_mask=None,
            past_key_values=None,
            use_cache=False,
            logits_to_keep=0,
            labels=None,
            position_ids=None,
        ):
            h = self.model.model.embed_tokens(input_ids)
            b, t = input_ids.shape
            presents = []
            for i, layer in enumerate(self.model.model.layers):
                attn = layer.self_attn
                q, k, v = attn.qkv(layer.input_layernorm(h)).view(b, t, 3, attn.n_heads, attn.head_dim).unbind(2)
                if past_key_values is not None:
                    k, v = (torch.cat([past, new], dim=1) for past, new in zip(past_key_values[i], (k, v)))
                presents.append((k, v))
                total = k.shape[1]
                keep = torch.ones(b, total, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
                causal = torch.ones(t, total, dtype=torch.bool).tril(total - t)
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=causal & keep[:, None, None, :]
                )
                h = h + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
                h = h + layer.mlp(layer.post_attention_layernorm(h))
            logits = self.model.lm_head(self.model.model.norm(h)[:, -logits_to_keep:, :])
            loss = shifted_cross_entropy(logits, labels) if labels is not None else None
            return CausalLMOutput(logits, presents if use_cache else None, loss, logits.new_zeros(()))

    model = byo_example.demo_model()
    adapter = BooleanMaskAdapter(model)
    assert check_adapter(adapter, lambda x: model(x)[0], IDS)
    return adapter.eval()


def test_a_decoder_leaving_a_padded_query_no_key_verifies_on_its_real_tokens(byo_example, tmp_path):
    # Verification judges real positions only: compared at every position, this decoder would fail the prefill
    # logits, every present, the loss (its first real token a target predicted from padding), the sweep and the
    # split-prefill invariant far beyond the tolerance, while every real token agrees.
    adapter = _boolean_mask_adapter(byo_example)
    folder = tmp_path / "boolean-mask"
    export_artifact(adapter, folder, source={"kind": "custom", "model": "boolean-mask"})
    # the sweep on: ragged padding, past and not
    settings = ParitySettings(decode_steps=2, greedy_tokens=4, probe=True)
    report = verify_artifact(
        folder, adapter, ["cpu"], settings, genai=False, transformers_js=False, golden_save=tmp_path / "golden"
    )
    assert report.passed, format_verify(report)
    [cpu] = report.reports
    assert all(layer.passed for layer in cpu.layers) and len(cpu.sweep) == 36 and len(report.invariants) == 6
    probe = cpu.localisation.probe
    assert probe.first is None and probe.checked == 23, probe  # every module output and present matched
    # the premise: the two sides do differ at the padded positions, and agree at the real ones
    manifest = read_manifest(folder)
    batch = prompt_batch(manifest, settings, np.random.default_rng(settings.seed))
    feeds = prefill_feeds(manifest, batch)
    ort = OrtRunner(Artifact(folder, manifest), "cpu").prefill(feeds)
    with torch.no_grad():
        ref = adapter(**{k: torch.from_numpy(v) for k, v in feeds.items()}, use_cache=True)
    real = batch["attention_mask"] == 1
    gap = np.abs(ort["logits"] - ref.logits.numpy())
    assert gap[~real].max() > 0.1 and gap[real].max() < 1e-4
    replayed = verify_artifact(folder, None, ["cpu"], genai=False, transformers_js=False, golden=tmp_path / "golden")
    assert replayed.passed, format_verify(replayed)


def _no_export_work(monkeypatch):
    def exported(*args, **kwargs):
        raise AssertionError("the export began before the refusal")

    monkeypatch.setattr(export_module, "copy_for_export", exported)


def _without_loss(adapter, loss=lambda out: None):
    forward = adapter.forward
    adapter.forward = lambda *a, **kw: (lambda out: dataclasses.replace(out, loss=loss(out)))(forward(*a, **kw))
    return adapter


@pytest.mark.parametrize(
    "loss, found",
    [
        (lambda out: None, "None"),
        (lambda out: out.logits.new_zeros(out.logits.shape[:2]), r"a Tensor of shape \(2, \d\)"),
    ],
    ids=["no loss", "per-token loss"],
)
def test_a_forward_without_a_scalar_loss_is_refused_unless_exported_without_the_loss(
    byo_example, tmp_path, loss, found
):
    # Refused before the export (the graph would compute its own loss), not left to verify_artifact's KeyError: 'loss'.
    model, adapter = _adapter(byo_example)
    _without_loss(adapter, loss)
    message = rf"loss is {found} with labels given, not a scalar tensor: .* \(with_loss=False, --no-loss\)"
    with pytest.raises(ModelError, match=message):
        check_adapter(adapter, lambda x: model(x)[0], IDS)
    assert check_adapter(adapter, lambda x: model(x)[0], IDS, with_loss=False)
    with pytest.raises(ExportFailed, match="the model's forward breaks the contract .*" + message):
        export_artifact(adapter, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_an_artifact_with_a_loss_is_judged_without_it_against_a_reference_giving_none(byo_example, byo_artifact):
    # An artifact with a loss, verified against an adapter giving none: judged without the loss, no KeyError: 'loss'.
    _, adapter = _adapter(byo_example)
    settings = ParitySettings(decode_steps=2, greedy_tokens=2, sweep=False)
    with_loss = verify_artifact(byo_artifact, adapter.eval(), ["cpu"], settings, genai=False, transformers_js=False)
    report = verify_artifact(
        byo_artifact, _without_loss(adapter), ["cpu"], settings, genai=False, transformers_js=False
    )
    assert report.passed, format_verify(report)
    names = [c.name for c in report.reports[0].comparisons]
    assert "prefill loss" in [c.name for c in with_loss.reports[0].comparisons] and "prefill loss" not in names
    assert len(names) == len(with_loss.reports[0].comparisons) - 1


def test_check_adapter_fails_when_either_comparison_is_off(byo_example):
    model, adapter = _adapter(byo_example)
    assert check_adapter(adapter, lambda x: model(x)[0], IDS)
    off = check_adapter(adapter, lambda x: model(x)[0] + 1e-3, IDS)  # the adapter differs from the original
    assert not off and off.cached_decode_max_abs <= off.atol < off.full_forward_max_abs
    forward = adapter.forward

    def cached_drift(*a, **kw):  # the full forward is right; a step through the cache is not
        out = forward(*a, **kw)
        return dataclasses.replace(out, logits=out.logits + 1e-3) if kw.get("past_key_values") else out

    adapter.forward = cached_drift
    drift = check_adapter(adapter, lambda x: model(x)[0], IDS)
    assert not drift and drift.full_forward_max_abs <= drift.atol < drift.cached_decode_max_abs


def test_check_adapter_names_the_form_of_original_logits(byo_example):
    # Passing the model itself (it returns (logits, loss)) is named as such, not "'tuple' object has no attribute
    # 'double'".
    model, adapter = _adapter(byo_example)
    with pytest.raises(
        ModelError,
        match=r"original_logits returned a tuple, not the logits \(2, 6, 256\) .*"
        r"lambda ids: model\(ids\)\[0\]",
    ):
        check_adapter(adapter, model, IDS)
    with pytest.raises(ModelError, match=r"original_logits returned a tensor of shape \(2, 5, 256\)"):
        check_adapter(adapter, lambda x: model(x)[0][:, 1:], IDS)


@dataclasses.dataclass(frozen=True)
class MySpec(DecoderSpec):
    """A user's own spec: DecoderSpec's fields and one more."""

    rope_theta: float = 1e4


def test_a_decoder_spec_subclass_exports_as_a_custom_decoder(byo_example, byo_artifact, tmp_path, monkeypatch):
    # A subclass of DecoderSpec is a DecoderSpec: exported as a custom decoder, not refused as "not the config of a
    # known family".
    _, adapter = _adapter(byo_example)
    adapter.config = MySpec(**dataclasses.asdict(adapter.config))
    replayed_export(monkeypatch, byo_artifact)  # skip the slow torch export: reuse the graphs
    result = export_artifact(adapter, tmp_path / "out")
    manifest = read_manifest(tmp_path / "out")
    assert manifest.family == result.manifest.family == "custom"
    assert manifest.config == DecoderSpec(
        **{f.name: getattr(adapter.config, f.name) for f in dataclasses.fields(DecoderSpec)}
    )


def test_a_config_of_no_known_family_is_refused_before_any_export_work(byo_example, tmp_path, monkeypatch):
    # A config missing fields is refused before any graph is built.
    _, adapter = _adapter(byo_example)
    adapter.config = types.SimpleNamespace(num_hidden_layers=2, vocab_size=256)
    _no_export_work(monkeypatch)
    with pytest.raises(ConfigError, match="SimpleNamespace is not the config of a known family"):
        export_artifact(adapter, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "source, problem",
    [
        ({"kind": "seeded"}, "model.source.preset is None, expected str"),
        ("my model", "model.source is a str, not an object"),
        ({"kind": "custom", "path": Path("model.pt")}, "model.source cannot be written as JSON .*PosixPath"),
        ({"model": "my-decoder"}, "model.source.kind is None, expected str"),
    ],
    ids=["seeded without preset", "a string", "a path", "no kind"],
)
def test_a_source_the_manifest_cannot_record_is_refused_before_any_export_work(
    byo_example, tmp_path, monkeypatch, source, problem
):
    # The first two exported, and inspect then called the folder inconsistent; the path failed after the export.
    _, adapter = _adapter(byo_example)
    _no_export_work(monkeypatch)
    with pytest.raises(InputError, match=rf"^source is .*: {problem}.*; pass a dict of JSON values"):
        export_artifact(adapter, tmp_path / "out", source=source)
    assert list(tmp_path.iterdir()) == []


def test_consumer_configs_take_query_heads_and_hidden_size_from_the_spec_and_inspect_marks_assumed_ones(byo_artifact):
    # A DecoderSpec may give its query-head count and hidden size; where it does not, config.json, genai_config.json
    # and inspect take kv heads and kv heads x head_dim, and inspect marks them assumed.
    manifest = read_manifest(byo_artifact)
    spec = manifest.config
    grouped = dataclasses.replace(
        spec, num_attention_heads=4 * spec.num_key_value_heads, hidden_size=4 * spec.num_key_value_heads * spec.head_dim
    )
    sizes = ModelSizes.of(dataclasses.replace(manifest, config=grouped))
    assert sizes.assumed == ()
    decoder = genai_config(manifest, sizes)["model"]["decoder"]
    hf = hf_config(manifest, sizes)
    for config in (decoder, hf):
        assert (config["num_attention_heads"], config["hidden_size"]) == (
            grouped.num_attention_heads,
            grouped.hidden_size,
        )
        assert config["num_key_value_heads"] == spec.num_key_value_heads
    # Heads x head_dim need not be the hidden size (Gemma's are not): genai's head_size is the cache's head_dim.
    wide = dataclasses.replace(
        spec,
        num_attention_heads=2 * spec.num_key_value_heads,
        hidden_size=3 * 2 * spec.num_key_value_heads * spec.head_dim,
    )
    wide_manifest = dataclasses.replace(manifest, config=wide)
    decoder = genai_config(wide_manifest, ModelSizes.of(wide_manifest))["model"]["decoder"]
    assert (decoder["head_size"], decoder["hidden_size"]) == (spec.head_dim, wide.hidden_size)
    bare = dataclasses.replace(manifest, config=dataclasses.replace(spec, num_attention_heads=None, hidden_size=None))
    assert (
        "assumed, not given by the config (in config.json and genai_config.json): num_attention_heads as the "
        "kv heads, hidden_size as heads x head_dim" in format_inspect(bare, str(byo_artifact), {})
    )
    hidden_only = dataclasses.replace(manifest, config=dataclasses.replace(grouped, hidden_size=None))
    assert format_inspect(hidden_only, str(byo_artifact), {}).count("assumed") == 1
    assert "): hidden_size as heads x head_dim\n" in format_inspect(hidden_only, str(byo_artifact), {})
    assert "assumed" not in format_inspect(manifest, str(byo_artifact), {})  # the example's spec gives both


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bogus"], "error: unrecognized arguments: --bogus (see 'byo_seed001.py --help')"),
        (["a", "b"], "error: unrecognized arguments: b (see 'byo_seed001.py --help')"),
        (["FILE"], "error: output folder FILE is a file; give the path of a folder (`folder`)"),
    ],
    ids=["an unknown option", "two folders", "a file as the folder"],
)
def test_the_bring_your_own_example_given_a_wrong_command_line_says_why_in_one_line(
    argv, message, tmp_path, monkeypatch, capsys
):
    # One line and exit 2 each, no traceback: an unknown option is not read as the folder to export into ("--bogus/").
    import runpy

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    script = Path(__file__).resolve().parents[2] / "examples" / "byo_seed001.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["byo_seed001.py", *[str(a_file) if a == "FILE" else a for a in argv]])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    assert exit_.value.code == 2
    assert capsys.readouterr().err == message.replace("FILE", str(a_file)) + "\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"] and a_file.read_text() == "mine"
