"""The options that several export-onnx commands share: the artifact FOLDER argument, the export's options (`export`
and `run`, passed on as one ExportOptions), and the verification's (`verify` and `run`, as one VerifyOptions, which
exporter.cli.verification checks and runs)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from pathlib import Path

import click

from exporter.artifact.quantization import (
    ALGORITHMS,
    DEFAULT_ACCURACY_LEVEL,
    DEFAULT_ALGORITHM,
    DEFAULT_BLOCK_SIZES,
    DEFAULT_EMBEDDING,
    DEFAULT_LM_HEAD,
    DEFAULT_SMOOTHING,
    TABLE_CHOICES,
)
from reference import DEFAULT_PRESET, PRESETS

DEFAULT_ROOT = Path("artifacts")  # where an export goes without --output, and the artifact FOLDER commands read

# Each report option by the parameter of write_reports (and write_error_reports) that takes its path.
REPORT_PARAMETERS = {"report_json": "json_path", "junit": "junit_path", "html": "html_path"}


class PathOption(click.Path):
    """A path option or argument; an empty one (an unset shell variable, say) is refused. It read as the current
    folder: `--save-optimized ""` wrote the optimised graphs there, `--checkpoint ""` read it as a model folder."""

    def __init__(self):
        super().__init__(path_type=Path)

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value.strip():
            self.fail("the path is empty; give a path (. for the current folder)", param, ctx)
        return super().convert(value, param, ctx)


def common_options(func):
    func = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")(func)
    func = click.option("-q", "--quiet", is_flag=True, help="No progress lines on stderr.")(func)
    func = click.option("-v", "--verbose", is_flag=True, help="Debug logging, with tracebacks of failures.")(func)
    return func


def folder_argument(func):
    """The artifact FOLDER that verify, generate and inspect read; the default preset's default export folder."""
    return click.argument("folder", type=PathOption(), default=DEFAULT_ROOT / DEFAULT_PRESET)(func)


@dataclass(frozen=True)
class ExportOptions:
    """The values of export_options, as click passes them (field names = the options' parameter names)."""

    preset: str | None
    checkpoint: Path | None
    config_path: Path | None
    seed: int
    output: Path | None
    dtype: str
    block_size: int | None
    accuracy_level: int | None
    quant_algorithm: str | None
    smoothing: str | None
    lm_head: str | None
    embedding: str | None
    activations: str | None
    no_loss: bool
    tokenizer: Path | None
    no_tokenizer: bool
    trace_all_layers: bool


def export_options(func):
    """The export's options, shared by `export` and `run`; --help lists them in this order. The command receives
    them as one ExportOptions, its keyword argument `to_export`."""

    @functools.wraps(func)
    def with_export_options(*args, **kwargs):
        values = {field.name: kwargs.pop(field.name) for field in fields(ExportOptions)}
        return func(*args, to_export=ExportOptions(**values), **kwargs)

    options = [
        click.option(
            "--preset",
            type=click.Choice(list(PRESETS), case_sensitive=False),
            default=None,
            help=f"Model configuration [default: {DEFAULT_PRESET}]. Weights are seeded, or read from "
            "--checkpoint, which must then fit the preset exactly.",
        ),
        click.option(
            "--checkpoint",
            type=PathOption(),
            default=None,
            help="Weights to export: a MiniMind .pth state dict or *_resume.pth, a .safetensors file, "
            "a Transformers folder (config.json + model.safetensors, sharded safetensors or "
            "pytorch_model.bin), a llama/mistral/qwen2/qwen3 .gguf file (dequantized to float32; needs "
            "pip install 'export-onnx[gguf]'), or a teaching-GPT {'model_state_dict': ...} file "
            "(.pt/.bin/.ckpt are read as .pth). "
            "Family and sizes are inferred from it unless --preset or --config is given.",
        ),
        click.option(
            "--config",
            "config_path",
            type=PathOption(),
            default=None,
            help="JSON file of config fields for a --checkpoint that carries none (toolkit or "
            "upstream names); fields it lacks are inferred from the checkpoint.",
        ),
        click.option(
            "--seed", type=int, default=0, show_default=True, help="Seed of the deterministic weight initialisation."
        ),
        click.option(
            "--output",
            "-o",
            type=PathOption(),
            default=None,
            help="Artifact folder [default: artifacts/<preset>, or for a --checkpoint "
            "artifacts/<its file name without suffix, or its folder name>, lowercased; -<dtype> "
            "appended for a dtype other than float32, then -float16 for --activations float16]. An "
            "earlier artifact there is replaced only once the new one is complete.",
        ),
        click.option(
            "--dtype",
            type=click.Choice(["float32", "float16", "int4", "int8"]),
            default="float32",
            show_default=True,
            help="Precision of the weights and activations; int4/int8 quantize the MatMul weights only "
            "(onnxruntime MatMulNBits), activations and cache stay float (see --activations).",
        ),
        click.option(
            "--block-size",
            type=int,
            default=None,
            help="int4/int8: weights per quantization scale (a power of two >= 16 dividing the hidden size) "
            f"[default: {DEFAULT_BLOCK_SIZES['int4']} for int4, {DEFAULT_BLOCK_SIZES['int8']} for int8].",
        ),
        click.option(
            "--accuracy-level",
            type=int,
            default=None,
            help=f"int4/int8: MatMulNBits accuracy_level [default: {DEFAULT_ACCURACY_LEVEL}] (4: int8 math on the "
            "CPU, as onnxruntime-genai's builder; 0: float32 math, slower than the float32 artifact on the CPU).",
        ),
        click.option(
            "--quant-algorithm",
            type=click.Choice(list(ALGORITHMS)),
            default=None,
            help=f"int4: how the 4-bit blocks are made [default: {DEFAULT_ALGORITHM}]: rtn, onnxruntime's "
            "round-to-nearest; hqq, its half-quadratic solver, which fits each block's zero point to its weights. "
            "8-bit blocks are round-to-nearest.",
        ),
        click.option(
            "--smoothing",
            default=None,
            metavar="ALPHA|none",
            help="int8 at accuracy level 4: move the outliers of each projection's input into its weights before "
            "they are rounded (SmoothQuant), with migration strength ALPHA in (0, 1], measured on "
            f"--calibration-text or a built-in text [default: {DEFAULT_SMOOTHING}; none: inputs left as they are].",
        ),
        click.option(
            "--lm-head",
            type=click.Choice(list(TABLE_CHOICES)),
            default=None,
            help="int4/int8: the lm_head's weights (tied or not) at 8 bits, float, or the same bits as the rest "
            f"[default: {DEFAULT_LM_HEAD}].",
        ),
        click.option(
            "--embedding",
            type=click.Choice(list(TABLE_CHOICES)),
            default=None,
            help="int4/int8: the token embedding's weights at 8 bits, float, or the same bits as the rest "
            f"(GatherBlockQuantized) [default: {DEFAULT_EMBEDDING}]; a tied table at the lm_head's bits is stored "
            "once.",
        ),
        click.option(
            "--activations",
            type=click.Choice(["float32", "float16"]),
            default=None,
            help="int4/int8: what the graphs compute in and the cache holds [default: float32, for the CPU; "
            "float16 for CUDA, where it halves every activation's and the cache's bytes]. Float dtypes compute "
            "in themselves.",
        ),
        click.option(
            "--no-loss", is_flag=True, help="Drop the labels input and loss output of prefill.onnx (inference-only)."
        ),
        click.option(
            "--tokenizer",
            type=PathOption(),
            default=None,
            help="tokenizer.json, or a folder with it (and tokenizer_config.json, chat_template.jinja), to copy "
            "into the artifact for text generation; its ids must fit the model's vocabulary [default: the "
            "--checkpoint's own: a folder's tokenizer.json, a GGUF's tokenizer].",
        ),
        click.option(
            "--no-tokenizer",
            is_flag=True,
            help="Leave the --checkpoint's tokenizer and chat template out of the artifact.",
        ),
        click.option(
            "--trace-all-layers",
            is_flag=True,
            help="Trace every layer with torch.onnx. By default a model whose layers repeat is traced three layers "
            "deep and its graph grown to its depth: the same graph in a fraction of the time.",
        ),
    ]
    for option in reversed(options):
        with_export_options = option(with_export_options)
    return with_export_options


def quality_target_options(func):
    """`export`'s --quality-target and --calibration-text: an int4/int8 export made to a quality target."""
    func = click.option(
        "--calibration-text",
        type=PathOption(),
        default=None,
        help="With --quality-target: a UTF-8 text, tokenized with the export's tokenizer; its first half ranks the "
        "modules by sensitivity (and measures --smoothing's inputs), its second half is held out and judges the "
        "artifact. Without it: the text an int8 export's --smoothing measures the inputs on.",
    )(func)
    return click.option(
        "--quality-target",
        default=None,
        metavar="kl=X[,top1=Y]",
        help="int4/int8: raise the precision of the modules whose rounding costs most (int4 -> int4 by HQQ, "
        "unless --quant-algorithm is given, -> int8; int8 -> float) until the artifact's mean KL from the float "
        "model is <= X (and top-1 agreement >= Y) on the held-out half of --calibration-text; exit 2 when no mix "
        "below the next precision keeps it.",
    )(func)


def provider_option(func):
    """--provider, ONNX Runtime's execution providers, and --runtime, the runtimes, to verify on."""
    func = click.option(
        "--runtime",
        "runtimes",
        multiple=True,
        metavar="NAME",
        help="Runtime to verify in (onnxruntime, openvino, or all for every installed one); repeatable. Each of its "
        "configurations is a row of the report. Default: onnxruntime.",
    )(func)
    return click.option(
        "--provider",
        "providers",
        multiple=True,
        metavar="NAME",
        help="ONNX Runtime execution provider to verify on (cpu, cuda, or a full name); repeatable. "
        "Default: every available one, the others reported as skipped.",
    )(func)


def genai_option(func):
    return click.option(
        "--genai/--no-genai",
        "genai",
        default=None,
        help="Also load the folder in onnxruntime-genai and compare its greedy tokens with the "
        "reference. Default: when onnxruntime-genai is installed and the family runs in it.",
    )(func)


def transformers_js_option(func):
    return click.option(
        "--transformers-js/--no-transformers-js",
        "transformers_js",
        default=None,
        help="Also load the folder in transformers.js (in Node) and compare its greedy tokens with the reference. "
        "Default: when node and the npm packages of `export-onnx install-node` are there.",
    )(func)


def verify_options(func):
    """The verification engine's options, shared by `verify` and `run`."""
    options = [
        click.option(
            "--decode-steps",
            type=click.IntRange(min=1),
            default=64,
            show_default=True,
            help="Stateful single-token decode steps (each feeding ONNX Runtime's own present back as "
            "past), then one 3-token step; cut to what the model's context leaves after the prompt.",
        ),
        click.option(
            "--sweep/--no-sweep",
            default=True,
            show_default=True,
            help="Shape sweep: batch {1,2,3} x new tokens {1,2,7,64} x past {0,1,17}, ragged padding.",
        ),
        click.option(
            "--long-context/--no-long-context",
            default=True,
            show_default=True,
            help="Long positions: across a rope scaling's original_max_position_embeddings and before "
            "max_position_embeddings (as position ids on a short cache), and a real cache of 512 positions.",
        ),
        click.option(
            "--probe",
            is_flag=True,
            help="Node-level localisation: debug copies of prefill.onnx (on the "
            "prefill batch) and decode.onnx (on the first failing decode "
            "call, fed the reference's past) exposing intermediate values "
            "name the first value that diverges from the reference's module "
            "outputs and presents (the model's, or those a golden bundle "
            "recorded), and the operator that computed it.",
        ),
        click.option(
            "--atol",
            multiple=True,
            metavar="KIND=V",
            help="Override a tolerance term for logits, kv or loss (repeatable), e.g. --atol logits=1e-3.",
        ),
        click.option("--rtol", multiple=True, metavar="KIND=V", help="Override rtol, e.g. --rtol kv=1e-3."),
        click.option(
            "--peak",
            multiple=True,
            metavar="KIND=V",
            help="Override the peak term, a multiple of the reference's max |value| added to the bound, "
            "e.g. --peak logits=0.",
        ),
        # multiple, to refuse a second file: click would keep the last one, silently
        click.option(
            "--tolerances",
            "tolerance_files",
            type=PathOption(),
            multiple=True,
            metavar="FILE",
            help='JSON or .toml file of overrides: {"logits": {"atol": 1e-3, "rtol": 1e-3}}.',
        ),
        click.option(
            "--report-json", type=PathOption(), default=None, metavar="PATH", help="Write the full JSON report here."
        ),
        click.option(
            "--junit",
            type=PathOption(),
            default=None,
            metavar="PATH",
            help="Write a JUnit XML report here (for CI systems).",
        ),
        click.option(
            "--html",
            type=PathOption(),
            default=None,
            metavar="PATH",
            help="Write a self-contained HTML report with plots here.",
        ),
        click.option(
            "--golden-save",
            type=PathOption(),
            default=None,
            metavar="DIR",
            help="Record the reference's inputs and outputs as a golden bundle in DIR, with the "
            "tolerance overrides of this run, which its replay applies.",
        ),
        click.option(
            "--fp16-companion",
            type=PathOption(),
            default=None,
            metavar="DIR",
            help="A float16 export of the same model: the precision leg of the CUDA attribution.",
        ),
    ]
    for option in reversed(options):
        func = option(func)
    return func


@dataclass(frozen=True)
class VerifyOptions:
    """The values of verify_options, as click passes them (keyword names = the options' parameter names)."""

    decode_steps: int
    sweep: bool
    long_context: bool
    probe: bool
    atol: tuple[str, ...]
    rtol: tuple[str, ...]
    peak: tuple[str, ...]
    tolerance_files: tuple[Path, ...]
    report_json: Path | None
    junit: Path | None
    html: Path | None
    golden_save: Path | None
    fp16_companion: Path | None

    def report_paths(self) -> dict:
        """The reports to write, by write_reports's (and write_error_reports's) keywords."""
        return {parameter: getattr(self, option) for option, parameter in REPORT_PARAMETERS.items()}
