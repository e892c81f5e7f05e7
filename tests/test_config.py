import dataclasses
import re
import typing

import pytest

from graphtrain.config import JOB_PRESETS, describe_key, describe_keys, load_config, to_toml
from models import MODEL_PRESETS


@pytest.mark.parametrize("name", list(JOB_PRESETS))
def test_every_preset_resolves_to_its_model(name):
    cfg = load_config(["--preset", name])
    assert cfg.preset == name
    assert cfg.model == MODEL_PRESETS[JOB_PRESETS[name]["model"]]


def test_default_is_tiny():
    assert load_config([]).preset == "tiny"


def test_overrides_are_typed():
    cfg = load_config(
        [
            "--training.steps=400",
            "--optim.lr",
            "1e-3",
            "--compile.dump_graphs",
            "--compile.passes=-a,+b",
            "--optim.betas=[0.8, 0.9]",
            "--data.tokenizer=42",
            "--model.tie_embeddings=true",
        ]
    )
    assert cfg.training.steps == 400 and isinstance(cfg.training.steps, int)
    assert cfg.optim.lr == 1e-3
    assert cfg.compile.dump_graphs is True
    assert cfg.compile.passes == ["-a", "+b"]
    assert cfg.optim.betas == [0.8, 0.9]
    assert cfg.data.tokenizer == "42"  # a str field keeps the text
    assert cfg.model.tie_embeddings is True


@pytest.mark.parametrize(
    "args, message",
    [
        (["--training.stepz=1"], "'training.stepz'"),
        (["--training.steps=abc"], "'training.steps' expects int, got 'abc'"),
        (["--training.steps=1.5"], "'training.steps' expects int"),
        (["--compile.enable=maybe"], "'compile.enable' expects bool"),
        (["--optim.betas=0.9"], "'optim.betas' expects a list of float"),
        (["--nosuch.key=1"], "unknown config section(s) ['nosuch']"),
        (["--preset", "huge"], "unknown preset 'huge'"),
        (
            ["--training.seq_len=4096"],
            "training.seq_len=4096 exceeds the model's model.max_seq_len=1024",
        ),
        (["--model.num_kv_heads=3"], "model.num_heads=4 is not divisible by model.num_kv_heads=3"),
        (["--model.mtp_depth=-1"], "model.mtp_depth must be >= 0 (0 turns MTP off), got -1"),
        (["--training.seed=-1"], "training.seed must be >= 0, got -1"),
        (
            ["--model.mtp_depth=8", "--training.seq_len=8"],
            "model.mtp_depth=8 needs training.seq_len > 8, got 8",
        ),
        (["--training.device=tpu"], "training.device must be one of"),
        (
            ["--training.dtype=float16"],
            "training.dtype='float16': float16 training needs loss scaling",
        ),
        (["--training.reduce_dtype=float16"], "training.reduce_dtype='float16': float16 training"),
        (
            ["--training.steps=30", "--schedule.warmup_steps=20"],
            "schedule.warmup_steps=20 + decay 12 (schedule.decay_ratio=0.4) exceed "
            "training.steps=30",
        ),
        (
            ["--schedule.warmup_steps=5", "--schedule.warmup_ratio=0.2"],
            "the command line sets both schedule.warmup_steps and schedule.warmup_ratio",
        ),
        (["--schedule.warmup_ratio=1.5"], "schedule.warmup_ratio must be in [0, 1], got 1.5"),
        (
            ["--training.activation_memory_budget=0"],
            "training.activation_memory_budget must be in (0, 1] (1: off), got 0.0",
        ),
        (["--training.activation_memory_budget=1.5"], "must be in (0, 1] (1: off), got 1.5"),
        (
            ["--training.activation_memory_budget=0.5", "--training.activation_checkpoint=full"],
            "training.activation_memory_budget=0.5 with training.activation_checkpoint='full'",
        ),
        (
            ["--training.activation_memory_budget=0.5", "--compile.enable=false"],
            "training.activation_memory_budget=0.5 needs compile.enable=true",
        ),
        (["steps=3"], "unexpected argument 'steps=3'"),
        (["--optim.lr=nan"], "'optim.lr' expects a finite number, got nan"),
        (
            ["--preset", "moe-tiny", "--model.bias_update_rate=inf"],
            "'model.bias_update_rate' expects a finite number, got inf",
        ),
        (
            ["--preset", "moe-tiny", "--model.z_loss_coef=-inf"],
            "'model.z_loss_coef' expects a finite number",
        ),
    ],
)
def test_bad_input_names_the_key(args, message):
    with pytest.raises(ValueError) as e:
        load_config(args)
    assert message in str(e.value)


def test_toml_file_and_precedence(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('preset = "debug"\n[training]\nsteps = 30\nseq_len = 32\n[optim]\nlr = 0.01\n')
    cfg = load_config(["--config", str(path), "--optim.lr=0.02"])
    assert cfg.preset == "debug" and cfg.model == MODEL_PRESETS["debug"]
    assert cfg.training.steps == 30 and cfg.training.seq_len == 32
    assert cfg.optim.lr == 0.02  # the command line wins over the file


def test_bad_toml_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[training\nsteps = 3\n")
    with pytest.raises(ValueError, match="not valid TOML"):
        load_config(["--config", str(path)])
    with pytest.raises(ValueError, match="does not exist"):
        load_config(["--config", str(tmp_path / "missing.toml")])
    path.write_text("[training]\nsteps = 'many'\n")
    with pytest.raises(ValueError, match=re.escape("'training.steps' expects int, got 'many'")):
        load_config(["--config", str(path)])
    path.write_text('preset = "moe-tiny"\n[model]\nroute_scale = nan\n')  # a TOML float
    with pytest.raises(ValueError, match=re.escape("'model.route_scale' expects a finite number")):
        load_config(["--config", str(path)])


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(["--preset", "debug", "--compile.passes=-x", "--optim.no_decay=a,b"])
    path = tmp_path / "config.toml"
    path.write_text(to_toml(cfg))
    assert load_config(["--config", str(path)]) == cfg


@pytest.mark.parametrize("preset", ["tiny", "moe-tiny"])
def test_describe_keys_lists_every_field_with_a_description(preset):
    cfg = load_config(["--preset", preset])
    text = describe_keys(cfg)
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if dataclasses.is_dataclass(section):
            for g in dataclasses.fields(section):
                assert f"--{f.name}.{g.name}=" in text
                # Every key has a description, in its field's metadata (models.fields.option).
                help_line = describe_key(
                    section, g.name, typing.get_type_hints(type(section))[g.name]
                )
                assert re.fullmatch(r"\([^)]+\) \S.*", help_line), (f.name, g.name, help_line)


def test_help_text_is_field_metadata():
    from graphtrain.config import sections

    for f in dataclasses.fields(sections.JobConfig):
        cls = f.type if isinstance(f.type, type) else getattr(sections, str(f.type), None)
        if cls is None or not dataclasses.is_dataclass(cls) or f.name == "model":
            continue
        for g in dataclasses.fields(cls):  # a key written without option(...) has no help
            assert g.metadata.get("help"), f"{f.name}.{g.name} has no help metadata"
    for cls in {type(cfg) for cfg in MODEL_PRESETS.values()}:
        for g in dataclasses.fields(cls):
            assert g.metadata.get("help"), f"model.{g.name} ({cls.__name__}) has no help metadata"
    text = describe_keys(load_config(["--preset", "hybrid-moe-debug"]))
    # A section's help over several source lines, joined; model keys, inherited ones too.
    assert (
        "(str: float32 | bfloat16) Storage (and update) dtype of the parameters: float32 keeps "
        "fp32 master weights; bfloat16 is pure bf16 training (half the parameter and gradient "
        "memory; see optim.fp32_grad_accum)." in " ".join(text.split())
    )
    assert "  --model.top_k=2\n      (int) routed experts per token k\n" in text
    assert "  --model.dim=64\n      (int) model width\n" in text
    assert '--model.layer_pattern="GGG*"\n      (str) token mixer per block, repeated' in text


def test_help_shows_type_default_choices_and_the_comment():
    text = describe_keys(load_config(["--preset", "debug", "--training.steps=7"]))
    # The default shown is this job's value; the choices come from the Literal type hint.
    assert "  --training.steps=7\n      (int) optimizer steps to train for\n" in text
    assert (
        '  --training.device="auto"\n      (str: auto | cuda | cpu) auto: cuda if available' in text
    )
    assert "(list of str)" in text
    # A choice the type does not list is refused with the list.
    with pytest.raises(ValueError, match=re.escape("('auto', 'flex', 'varlen', 'sdpa', 'causal')")):
        load_config(["--training.attention=flash"])


def test_toml_strings_are_refused_for_numbers_and_bools(tmp_path):
    path = tmp_path / "job.toml"
    for text, message in [
        ('[training]\nsteps = "30"\n', "'training.steps' expects int, got '30'"),
        ('[optim]\nlr = "1e-3"\n', "'optim.lr' expects float, got '1e-3'"),
        ('[compile]\nenable = "false"\n', "'compile.enable' expects bool, got 'false'"),
    ]:
        path.write_text(text)
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(["--config", str(path)])
    # The command line's text is parsed as before.
    cfg = load_config(["--training.steps", "30", "--optim.lr=1e-3", "--compile.enable=0"])
    assert (cfg.training.steps, cfg.optim.lr, cfg.compile.enable) == (30, 1e-3, False)


@pytest.mark.parametrize("preset", ["tiny", "moe-tiny", "debug"])
def test_short_runs_keep_the_presets_schedule_shape(preset):
    full = load_config(["--preset", preset])
    # The presets' own lengths keep their warm-up in steps (20 for tiny and moe-tiny).
    assert full.warmup_steps == {"tiny": 20, "moe-tiny": 20, "debug": 2}[preset]
    short = load_config(["--preset", preset, "--training.steps=30"])
    assert short.warmup_steps == round(full.schedule.warmup_ratio * 30)
    assert short.warmup_steps + short.decay_steps <= 30


def test_warmup_steps_and_ratio_override_each_other_across_layers(tmp_path):
    # A later layer setting one spelling replaces the other from the layers below.
    cfg = load_config(["--preset", "tiny", "--schedule.warmup_steps=7"])
    assert cfg.warmup_steps == 7
    path = tmp_path / "job.toml"
    path.write_text("[schedule]\nwarmup_steps = 9\n")
    cfg = load_config(["--config", str(path), "--schedule.warmup_ratio=0.5"])
    assert cfg.schedule.warmup_steps == -1 and cfg.warmup_steps == 90
    # The resolved config writes only the spelling in effect, so it reads back.
    path.write_text(to_toml(load_config(["--schedule.warmup_steps=7"])))
    assert load_config(["--config", str(path)]).warmup_steps == 7


def test_lce_mode_and_budget_are_checked_and_reach_the_passes():
    from graphtrain.config import CompileConfig, JobConfig, pass_options

    with pytest.raises(ValueError, match=r"compile.lce_mode must be one of .*'quick'"):
        CompileConfig(lce_mode="quick")
    with pytest.raises(ValueError, match=r"lce_memory_budget must be >= 0, got -1"):
        CompileConfig(lce_memory_budget=-1)
    with pytest.raises(ValueError, match="whole number of bytes"):
        CompileConfig(lce_memory_budget=1.5)
    cfg = JobConfig(compile=CompileConfig(lce_mode="low_memory", lce_memory_budget=1 << 30))
    options = pass_options(cfg)
    assert (options["lce_mode"], options["lce_memory_budget"]) == ("low_memory", 1 << 30)


def test_fp8_switch_and_filters():
    """training.fp8 turns the fp8_linear pass on (once, also when read back from config.toml);
    the [fp8] filters reach the passes through pass_options; bad values name the key."""
    from graphtrain.config import pass_options

    cfg = load_config(["--preset", "debug", "--training.fp8=true", "--fp8.min_dim=64"])
    assert cfg.compile.passes == ["+fp8_linear"]
    again = load_config(
        ["--preset", "debug", "--training.fp8=true", "--compile.passes=+fp8_linear"]
    )
    assert again.compile.passes == ["+fp8_linear"]
    options = pass_options(cfg)
    assert options["fp8.min_dim"] == 64 and options["fp8.exclude"] == ["*output", "*router*"]
    assert load_config(["--preset", "debug"]).compile.passes == []
    bad = [
        (["--compile.passes=-fp8_linear"], "contradicts compile.passes"),
        (["--compile.enable=false"], "needs compile.enable=true"),
        (["--fp8.multiple_of=8"], "fp8.multiple_of must be a multiple of 16"),
        (["--fp8.min_dim=0"], "fp8.min_dim must be > 0"),
        (["--fp8.include=[]"], "fp8.include is empty"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            load_config(["--preset", "debug", "--training.fp8=true", *args])
    with pytest.raises(ValueError, match=r"fsdp_all_gather_fp8=true needs training\.fp8=true"):
        load_config(["--preset", "debug", "--fp8.fsdp_all_gather_fp8=true"])
    with pytest.raises(ValueError, match=r"without tensor parallelism, got parallel\.tp=2"):
        load_config(["--preset", "debug", "--training.fp8=true", "--fp8.fsdp_all_gather_fp8=true",
                     "--parallel.tp=2"])  # fmt: skip
