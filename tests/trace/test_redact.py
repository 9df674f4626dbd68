"""Credentials never reach a trace: the redaction rules (docs/trace-format.md, "What is redacted"),
and a real recording whose command line and environment carry secrets.

Token-shaped literals are split ("hf_" + "...") so that secret scanners do not flag this file.
"""

from __future__ import annotations

import base64
import json
import os
import random
from pathlib import Path

import pytest
from harness import CLI, child_env, run, torchrun_cmd

from fsdp_replay.trace import redact, schema
from fsdp_replay.trace.reader import Trace

R = schema.REDACTED


def plain(value: str) -> str:
    """``value`` with each marker, keyed (``record`` makes a key per run) or not, as ``R``."""
    return schema.REDACTED_RE.sub(R, value)


WORKLOADS = Path(__file__).parents[1] / "workloads"

B64_TOKEN = "7vJGM4aj47KQmVow+ymdb1B5WAouLGL6"  # 32 random base64 characters
URLSAFE_TOKEN = "uDNfhYenYqpJrv-GzaO7kKXAG2Mdf9g_"
HEX_KEY = "f7a7464a0b9e3d74039fd2211cc546a5a4737dce"  # 40 hex digits (also the shape of a git SHA)
PREFIXED = {
    "hugging face": "hf_" + "xQ7bN2kLmP9vR4sT1wY6zA3cD8eF5gHjK",
    "github ghp": "ghp_" + "a1B2c3D4e5F6g7H8i9J0kLmNoPqRsTuVwXyZ",
    "github gho": "gho_" + "Z9y8X7w6V5u4T3s2R1q0PoNmLkJiHgFeDcBa",
    "github ghu": "ghu_" + "Q1w2E3r4T5y6U7i8O9p0AsDfGhJkLzXcVbNm",
    "github ghs": "ghs_" + "m1N2b3V4c5X6z7L8k9J0hGfDsApOiUyTrEwQ",
    "github ghr": "ghr_" + "p0O9i8U7y6T5r4E3w2Q1aSdFgHjKlZxCvBnM",
    "github pat": "github_pat_" + "11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCD",
    "aws akia": "AKIA" + "IOSFODNN7EXAMPLE",
    "aws asia": "ASIA" + "Y34FZKBOKMUTVV7A",
    "slack xoxb": "xoxb-" + "2048-1024-abcdefGHIJKL",
    "slack xoxp": "xoxp-" + "1234567890-abcdef",
    "openai sk-proj": "sk-" + "proj-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2",
    "anthropic sk-ant": "sk-" + "ant-api03-aB1cD2eF3gH4iJ5kL6mN7",
    "stripe": "sk_" + "live_4eC39HqLyjWDarjtT1zdp7dc",
    "gitlab": "glpat-" + "xYz12AbC34dEf56GhI78",
    "jwt": "eyJ"
    + "hbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.dozjgNryP4J3jVmNHl0w5N_XgL0n3I9PlFUP0THsR8U",
    "random base64": B64_TOKEN,
    "random base64url": URLSAFE_TOKEN,
    "40-hex api key": HEX_KEY,
}

# Names whose value is hidden, each checked in the forms --name V, --name=V (below).
SECRET_FLAGS = [
    "--wandb-key",
    "--api_key",
    "--api-key",
    "--apiKey",
    "--APIKEY",
    "--key",
    "--KEY",
    "-key",
    "--openai-api-key",
    "--token",
    "--hf_token",
    "--HF-TOKEN",
    "--auth-token",
    "--authtoken",
    "--use_auth_token",
    "--access-token",
    "--secret",
    "--client-secret",
    "--clientSecret",
    "--aws_secret_access_key",
    "--db-pass",
    "--pass",
    "--passwd",
    "--password",
    "--Password",
    "--dbPassword",
    "--db_password",
    "--passphrase",
    "--pwd",
    "-password",
    "--auth",
    "--authorization",
    "--authn",
    "--oauth",
    "--credential",
    "--credentials",
    "--gcp-credentials-json",
    "--creds",
    "--cookie",
    "--session-cookie",
    "--session",
    "--session_key",
    "--sessionid",
    "--private",
    "--private-key",
    "--privatekey",
    "--ssh.private_key",
    "--signature",
    "--url-signature",
    "-p",
]
# NAME=value arguments (env-style, Hydra overrides) whose value is hidden.
SECRET_ASSIGNMENTS = [
    "HF_KEY",
    "WANDB_API_KEY",
    "GITHUB_TOKEN",
    "DB_PASS",
    "PASSWORD",
    "db.password",
    "+trainer.logger.wandb.api_key",
    "++auth.basic.passwd",
]
# Names that must not hide their value: parts, not substrings; qualifiers; plurals that count.
NOT_SECRET_FLAGS = [
    "--keep",
    "--monkey-patch",
    "--key-frames",
    "--keypoints",
    "--hockey",
    "--author",
    "--authors",
    "--authority",
    "--tokenizer",
    "--tokenizer_name",
    "--max-tokens",
    "--max_tokens",
    "--num_tokens",
    "--pad-token-id",
    "--pad_token_id",
    "--token_type_ids",
    "--num-keys",
    "--key_len",
    "--auth-type",
    "--session-id",
    "--hub_private_repo",
    "--bypass",
    "--lowpass",
    "--compass",
    "--passes",
    "-P",
    "--pp",
]

# Realistic arguments that are not secrets: kept byte for byte.
NOT_SECRETS = [
    "train.py",
    "/data/imagenet/train-00001-of-00128.tar",
    "/data/imagenet/train/n01440764/n01440764_10026.JPEG",
    "meta-llama/Llama-3.1-8B-Instruct",
    "mistralai/Mixtral-8x7B-Instruct-v0.1",
    "sentence-transformers/all-MiniLM-L6-v2",
    "hf-internal-testing/tiny-random-LlamaForCausalLM",
    "Qwen/Qwen2-VL-72B-Instruct-GPTQ-Int4",
    "bert-base-uncased",
    "--model_class=Pix2StructForConditionalGeneration",
    "Wav2Vec2ForSequenceClassification",
    "MobileNetV2ForSemanticSegmentation",
    "--lr=3e-4",
    "--lr",
    "3e-4",
    "--weight-decay=-0.1",
    "--output_dir=./checkpoints/run_2026_12_01",
    "--run-name=run_2026_12_01_llama_8b_fsdp2_seed_42",
    "--exp=lr3e-4_bs256_wd0p1_warmup2000_cosine",
    "--nproc_per_node=8",
    "--nnodes=2",
    "--rdzv-endpoint=localhost:29500",
    "localhost:29500",
    "--master_addr=train-job-7f9c8d6b5-x2k4p-worker-0",
    "--config=configs/llama_8b_fsdp2.yaml",
    "--deepspeed=ds_config_zero3_offload_nvme.json",
    "--data=s3://ml-data-prod/tokenized/llama3/shard_000123_of_004096.bin",
    "gs://bucket/c4/en/c4-train.00001-of-01024.json.gz",
    "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/resolve/main/config.json",
    "http://localhost:8080/metrics?job=train&rank=0",
    "/tmp/pytest-of-root/pytest-12/test_credentials_appear_nowhere0/rec",
    "/work/main/.venv/lib/python3.11/site-packages",
    "--save-params",
    "/x/params-{rank}.pt",
    "2026-12-01",
    "2026-12-01T10:30:00Z",
    "42",
    "-1",
    "0.0001",
    "1234567890123456789012345678901234567890",
    "abcdefghijklmnopqrstuvwxyz0123456789",
    "123e4567-e89b-42d3-a456-426614174000",  # a UUID: torchrun's run id
    "--fsdp_sharding_strategy=FULL_SHARD",
    "expandable_segments:True",
    "--task=mask-rcnn-resnet50-fpn-coco-2017-finetune",
    "--wandb_run_id=a1b2c3d4",
    "--prompt=The key insight: tokens are cheap",
    "--",
]


def _case(argv: list[str], expected: list[str]) -> object:
    return pytest.param(argv, expected, id=" ".join(argv)[:60])


ARGV_CASES = [
    # secret names, both forms
    *(_case([f, "hunter2"], [f, R]) for f in SECRET_FLAGS),
    *(_case([f"{f}=hunter2"], [f"{f}={R}"]) for f in SECRET_FLAGS),
    *(_case([f"{n}=hunter2"], [f"{n}={R}"]) for n in SECRET_ASSIGNMENTS),
    *(_case([f, "hunter2"], [f, "hunter2"]) for f in NOT_SECRET_FLAGS),
    *(_case([f"{f}=hunter2"], [f"{f}=hunter2"]) for f in NOT_SECRET_FLAGS),
    # secret values, wherever they are
    *(_case([v], [R]) for v in PREFIXED.values()),
    *(_case(["--x", v], ["--x", R]) for v in PREFIXED.values()),
    *(_case([f"--resume={v}"], [f"--resume={R}"]) for v in PREFIXED.values()),
    *(_case([f"X={v}"], [f"X={R}"]) for v in PREFIXED.values()),
    _case(["--pad-token-id", B64_TOKEN], ["--pad-token-id", R]),  # a qualified name: value rules still apply
    _case([f"--header=Authorization: Bearer {B64_TOKEN[:12]}"], [f"--header={R}"]),
    _case(["-H", "authorization: bearer abcdefgh12"], ["-H", R]),
    _case(["-H", "X-Api-Key: 12345"], ["-H", R]),
    _case([f"https://hf.co/x?token={PREFIXED['hugging face']}"], [f"https://hf.co/x?token={R}"]),
    _case([f"/cache/snapshots/{HEX_KEY}/config.json"], [R]),  # a git SHA: an accepted false positive
    # URL passwords: only the password goes
    _case(["https://user:hunter2@host/x"], [f"https://user:{R}@host/x"]),
    _case(["--db=postgres://u:p%40ss@db:5432/x"], [f"--db=postgres://u:{R}@db:5432/x"]),
    _case(["redis://:hunter2@cache:6379/0"], [f"redis://:{R}@cache:6379/0"]),
    _case(["https://u:p@ss@host/x"], [f"https://u:{R}@host/x"]),
    _case(["https://u:pw@host/x?a=b"], [f"https://u:{R}@host/x?a=b"]),
    _case(["git+https://bot:hunter2@git.example/r.git"], [f"git+https://bot:{R}@git.example/r.git"]),
    # the value after a secret flag
    _case(["--private", "--lr", "3e-4"], ["--private", "--lr", "3e-4"]),
    _case(["--token", "--", "x"], ["--token", "--", "x"]),
    _case(["--password", "-x7Ab"], ["--password", R]),
    _case(["--token"], ["--token"]),
    _case(["-p", "hunter2", "train.py", "-p=x"], ["-p", R, "train.py", f"-p={R}"]),
    _case(["--api-key=", "x"], [f"--api-key={R}", "x"]),
    # the non-secrets, all in one argv
    _case(NOT_SECRETS, NOT_SECRETS),
]


@pytest.mark.parametrize(("argv", "expected"), ARGV_CASES)
def test_redact_argv(argv: list[str], expected: list[str]) -> None:
    assert redact.redact_argv(argv) == expected


@pytest.mark.parametrize("arg", NOT_SECRETS)
def test_non_secrets_are_kept(arg: str) -> None:
    assert redact.redact_argv([arg]) == [arg]
    assert redact.redact_value(arg) == arg


def test_existing_forms_still_redacted() -> None:
    argv = [
        "train.py",
        "--api-key",
        "argv-key-77aa",
        "--password=sk-" + "Zx9Yw8Vu7Ts6Rq5Po4Nm3",
        "--steps",
        "2",
    ]
    assert redact.redact_argv(argv) == ["train.py", "--api-key", R, f"--password={R}", "--steps", "2"]


def test_image_digests_are_kept_and_other_hex_still_hidden() -> None:
    """A pinned image (``repo@sha256:<64 hex>``) is the hash of public bytes: a replay Job needs it
    (FSDP_REPLAY_POD_IMAGE); the same hex anywhere else is still taken for a key."""
    digest = "sha256:" + HEX_KEY[:64].lower().ljust(64, "0")
    image = f"registry.example/ml/train@{digest}"
    assert redact.redact_value(image) == image
    assert redact.redact_env({"FSDP_REPLAY_POD_IMAGE": image}) == {"FSDP_REPLAY_POD_IMAGE": image}
    assert redact.redact_value(f"registry.example/ml/train:1.0@{digest}") != R
    for hidden in (digest, f"x/{digest}", f"@sha256:{digest[7:].upper()}", f"{image}0", f"{image} {HEX_KEY}"):
        assert redact.redact_value(hidden) == R, hidden


def test_name_parts() -> None:
    assert redact.name_parts("--wandbApiKey2") == ["wandb", "api", "key", "2"]
    assert redact.name_parts("HFToken") == ["hf", "token"]
    assert redact.name_parts("+trainer.logger.wandb.api_key") == ["trainer", "logger", "wandb", "api", "key"]


def test_redact_env() -> None:
    env = {
        "HOME": "/root",  # every variable is recorded (a replay leaves the machine's own alone)
        "HF_TOKEN": PREFIXED["hugging face"],
        "MY_SERVICE_TOKEN": "tok-4f1c9e2d7a5b",
        "TORCH_HUB_TOKEN": "hunter2",  # allowed prefix, secret name
        "NCCL_IB_PASSWORD": "pw-93c1d0aa",
        "FSDP_REPLAY_API_KEY": "x",
        "GLOO_AUTH_KEY": "y",
        "TORCH_HOME": "https://alice:hunter2pw@example.invalid/cache",  # secret value: only the password
        "NCCL_SOME_SETTING": PREFIXED["github ghp"],
        "NCCL_OTHER_SETTING": B64_TOKEN,
        "TORCHELASTIC_RUN_ID": "5c4d8b1e-9f0a-4e2b-8c3d-7a6b5c4d3e2f",
        "NCCL_IB_PKEY": "0",  # an InfiniBand partition key: "pkey" is not "key"
        "NCCL_SOCKET_IFNAME": "eth0",
        "PYTHONPATH": "/run/rec/.agent-path:/work/main/.venv/lib/python3.11/site-packages",
        "MASTER_ADDR": "train-job-master-0.train-job.default.svc",
        "MASTER_PORT": "29500",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "FSDP_REPLAY_OUT": "/tmp/pytest-of-root/pytest-3/test_secrets_never_reach_a_tr0/rec",
    }
    out = redact.redact_env(env)
    assert list(out) == sorted(out)
    assert out == {
        "FSDP_REPLAY_API_KEY": R,
        "FSDP_REPLAY_OUT": env["FSDP_REPLAY_OUT"],
        "GLOO_AUTH_KEY": R,
        "HF_TOKEN": R,
        "HOME": "/root",
        "MASTER_ADDR": env["MASTER_ADDR"],
        "MASTER_PORT": "29500",
        "MY_SERVICE_TOKEN": R,
        "NCCL_IB_PASSWORD": R,
        "NCCL_IB_PKEY": "0",
        "NCCL_OTHER_SETTING": R,
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_SOME_SETTING": R,
        "PYTHONPATH": env["PYTHONPATH"],
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCHELASTIC_RUN_ID": env["TORCHELASTIC_RUN_ID"],
        "TORCH_HOME": f"https://alice:{R}@example.invalid/cache",
        "TORCH_HUB_TOKEN": R,
    }


@pytest.mark.parametrize(
    ("alphabet", "nchars", "min_found"),
    [
        ("base64", 24, 0.9),
        ("base64", 32, 0.97),
        ("base64", 44, 0.99),
        ("base64url", 32, 0.97),
        ("hex", 32, 1.0),
        ("hex", 40, 1.0),
        ("mixed-case alphanumeric", 32, 0.97),
    ],
)
def test_random_tokens_are_found(alphabet: str, nchars: int, min_found: float) -> None:
    """The random-string heuristic, measured on seeded random tokens (its documented power)."""
    rng = random.Random(f"{alphabet}{nchars}")
    found = 0
    for _ in range(2000):
        raw = rng.randbytes(nchars)
        if alphabet == "hex":
            token = raw.hex()[:nchars]
        elif alphabet == "base64":
            token = base64.b64encode(raw).decode()[:nchars]
        elif alphabet == "base64url":
            token = base64.urlsafe_b64encode(raw).decode()[:nchars]
        else:
            chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
            token = "".join(rng.choice(chars) for _ in range(nchars))
        found += redact.redact_value(token) == R
    assert found / 2000 >= min_found


# -- a real recording -------------------------------------------------------------------------
@pytest.mark.slow
def test_secrets_never_reach_run_json_spools_or_trace(tmp_path: Path) -> None:
    secret_args = {
        "--wandb-key": "wandbkey-3141-argv",
        "--db-pass": "dbpass-2718-argv",
        "-p": "shortp-1618-argv",
        "--auth-token": "authtok-1414-argv",
    }
    eq_args = {
        "--api_key": "apikey-1732-argv",
        "--session-cookie": "cookie-2236-argv",
        "HF_KEY": "hfkey-2646",
    }
    url_password = "urlpw-3316-argv"
    bare_token = PREFIXED["github ghp"]
    env_secrets = {
        "TORCH_HUB_TOKEN": "hubtok-4123-env",  # allow-listed prefix, secret name
        "NCCL_FSDP_REPLAY_TEST_SETTING": PREFIXED["hugging face"],  # allow-listed, secret value
        "TORCH_HOME": "https://alice:envpw-5099@example.invalid/cache",  # URL password
        "MY_SERVICE_PASSWORD": "notallowed-6180-env",  # a secret name anywhere
    }
    script_args = [
        *(a for kv in secret_args.items() for a in kv),
        *(f"{k}={v}" for k, v in eq_args.items()),
        "--url",
        f"https://alice:{url_password}@example.invalid/data",
        bare_token,
        "--steps",
        "2",
    ]
    out = tmp_path / "rec"
    run(
        [
            *CLI,
            "record",
            "--out",
            str(out),
            "--keep-spool",
            "--",
            *torchrun_cmd(2, WORKLOADS / "tiny_train.py", *script_args),
        ],
        env=child_env(**env_secrets),
    )
    needles = [
        *secret_args.values(),
        *eq_args.values(),
        url_password,
        bare_token,
        "hubtok-4123-env",
        PREFIXED["hugging face"],
        "envpw-5099",
        "notallowed-6180-env",
    ]

    def assert_clean(blob: bytes, where: str) -> None:
        for n in needles:
            assert n.encode() not in blob, f"{n!r} leaked into {where}"

    spools = list((out / schema.SPOOL_DIR).rglob("*.fsrs"))
    assert len({p.parent for p in spools}) == 2, "one spool per rank, kept by --keep-spool"
    zarr_json = 0
    for root, _dirs, files in os.walk(out):  # symlinks (.agent-path) are not followed
        for name in files:
            path = Path(root) / name
            if not path.is_symlink():
                assert_clean(path.read_bytes(), str(path))
                zarr_json += name == "zarr.json"
    assert zarr_json > 0
    # chunk data is compressed: search what the reader decodes too
    trace = Trace.open(out / schema.TRACE_DIR)
    assert_clean(json.dumps(trace.meta).encode(), "the trace's root attributes")
    assert trace.ranks == [0, 1]
    for r in trace.ranks:
        rt = trace.rank(r)
        assert_clean(json.dumps(rt.attrs).encode(), f"rank {r}'s attributes")
        meta = rt.meta
        assert all(plain(m) != m for m in (meta["env"]["TORCH_HUB_TOKEN"], meta["argv"][2])), "keyed markers"
        argv = [plain(a) for a in meta["argv"]]
        env = {k: plain(v) for k, v in meta["env"].items()}
        for flag in secret_args:
            assert argv[argv.index(flag) + 1] == R
        assert f"--api_key={R}" in argv and f"HF_KEY={R}" in argv
        assert f"https://alice:{R}@example.invalid/data" in argv
        assert env["TORCH_HUB_TOKEN"] == R
        assert env["NCCL_FSDP_REPLAY_TEST_SETTING"] == R
        assert env["TORCH_HOME"] == f"https://alice:{R}@example.invalid/cache"
        assert env["MY_SERVICE_PASSWORD"] == R
        assert schema.has_redacted(" ".join(meta["orig_argv"]))
    command = [plain(a) for a in json.loads((out / "run.json").read_text())["command"]]
    assert command[command.index("--wandb-key") + 1] == R
    assert "--nproc_per_node=2" in command
