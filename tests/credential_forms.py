"""Credential forms for the redaction tests: where each is planted, and the secret to look for.

Each secret is made from a seeded random generator at import (unique, realistic, and never a
literal in this file: secret scanners have nothing to flag here). A form is planted in an
environment variable, in the command line, or in free text (an exception's message, a line of
source a stack dump shows); ``needles`` are the secret parts that must appear nowhere.
"""

from __future__ import annotations

import base64
import random
import string
from dataclasses import dataclass, field

_RNG = random.Random("fsdp-replay credential forms")
_ALNUM = string.ascii_letters + string.digits


def alnum(n: int, prefix: str = "") -> str:
    """A random mixed-case alphanumeric string of n characters after ``prefix``, with a digit."""
    body = "".join(_RNG.choice(_ALNUM) for _ in range(n - 1))
    return prefix + body + _RNG.choice(string.digits)


def b64(nbytes: int) -> str:
    return base64.b64encode(_RNG.randbytes(nbytes)).decode()


def hexdigits(n: int) -> str:
    return _RNG.randbytes(n).hex()[:n]


def pem(kind: str, escaped: bool = False) -> tuple[str, str]:
    """(a private key block, its first body line)."""
    lines = [b64(48) for _ in range(3)]
    nl = "\\n" if escaped else "\n"
    return nl.join([f"-----BEGIN {kind}-----", *lines, f"-----END {kind}-----"]), lines[0]


@dataclass(frozen=True)
class Form:
    name: str
    needles: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    argv: tuple[str, ...] = ()
    text: str = ""


def _forms() -> list[Form]:
    f: list[Form] = []

    def add(name: str, needles: tuple[str, ...] | str, **where: object) -> None:
        f.append(Form(name, (needles,) if isinstance(needles, str) else needles, **where))  # type: ignore[arg-type]

    # the audit's forms
    s = alnum(14, "rds")
    add("env REDIS_PW", s, env={"REDIS_PW": s})
    s = alnum(12, "pc")
    add("env DB_PASSCODE", s, env={"DB_PASSCODE": s})
    s = alnum(14, "jdbc")
    add(
        "JDBC password= parameter",
        s,
        env={"WAREHOUSE_JDBC": f"jdbc:postgresql://db.internal:5432/app?user=svc&password={s}&ssl=true"},
    )
    s = alnum(20, "qt")
    add(
        "?token= query parameter",
        s,
        env={"FEED_URL": f"https://feeds.example.com/v1/items?limit=5&token={s}"},
    )
    s = alnum(13, "cs")
    add(
        "Password= in a connection string",
        s,
        env={"MSSQL_CONN": f"Server=db1;Database=app;User Id=svc;Password={s};"},
    )
    s = hexdigits(32)
    add("Sentry DSN", s, env={"ERROR_REPORTER": f"https://{s}@o123456.ingest.sentry.io/4504"})
    s = alnum(12, "pw")
    add("argv --pw X", s, argv=("--pw", s))
    s = alnum(12, "code")
    add("argv --passcode X", s, argv=("--passcode", s))
    s = alnum(12, "lg")
    add("argv --login user:pw", s, argv=("--login", f"svc-account:{s}"))
    s = alnum(12, "ex")
    add(
        "user:pass@host URL in an exception",
        s,
        text=f"cannot reach postgres://admin:{s}@db.internal:5432/app",
    )
    s = alnum(14, "dburl")
    add("DATABASE_URL (replay notes)", s, env={"DATABASE_URL": f"postgresql://app:{s}@db.internal:5432/app"})
    # more forms
    s = b64(30)[:40]
    add(
        "AWS secret access key in a source line",
        s,
        text=f'session(aws_secret_access_key="{s}", region="eu-west-1")',
    )
    key, first = pem("RSA PRIVATE KEY")
    add("private key PEM", first, env={"TLS_BUNDLE": key})
    s = alnum(24)
    add(
        "Slack webhook URL",
        s,
        env={
            "ALERTS_WEBHOOK": f"https://hooks.slack.com/services/T0{alnum(8).upper()}/B0{alnum(8).upper()}/{s}"
        },
    )
    key, first = pem("PRIVATE KEY", escaped=True)
    key_id = hexdigits(40)
    add(
        "GCP service-account JSON",
        (first, key_id),
        env={
            "GOOGLE_SA_JSON": '{"type": "service_account", "project_id": "ml-prod", "private_key_id": "'
            + key_id
            + '", "private_key": "'
            + key
            + '\\n", "client_email": "trainer@ml-prod.iam.gserviceaccount.com"}'
        },
    )
    user_pw = base64.b64encode(f"svc:{alnum(12)}".encode()).decode()
    add("basic-auth header", user_pw, argv=("-H", f"Authorization: Basic {user_pw}"))
    s = b64(66)
    add(
        "Azure storage connection string AccountKey=",
        s,
        env={
            "AZURE_STORAGE_CONNECTION_STRING": "DefaultEndpointsProtocol=https;AccountName=mlprod;"
            f"AccountKey={s};EndpointSuffix=core.windows.net"
        },
    )
    s = alnum(12, "pip")
    add(
        "password in pip --index-url",
        s,
        env={"INSTALL_CMD": f"pip install --index-url https://deploy:{s}@pypi.example.com/simple mypkg"},
    )
    s = alnum(12, "my")
    add("mysql -pPASSWORD", s, argv=(f"--init-cmd=mysql -uroot -p{s} app",))
    s = alnum(36, "ghp_")
    add("GitHub token in an exception", s, text=f"push to the model hub failed with {s}")
    s = alnum(30, "sk_live_")
    add("Stripe key under a plain name", s, env={"PAYMENTS_BACKEND": s})
    s = alnum(12, "odbc")
    add(
        "ODBC PWD=",
        s,
        env={"REPORTING_DB": "DRIVER={ODBC Driver 18 for SQL Server};SERVER=tcp:db;UID=svc;PWD=" + s},
    )
    s = alnum(22, "sig")
    add(
        "Azure SAS sig= parameter",
        s,
        env={"BLOB_URL": f"https://acct.blob.core.windows.net/c/x.bin?sv=2022-11-02&sp=r&sig={s}%3D"},
    )
    s = alnum(14, "src")
    add("password= in a source line", s, text=f'client = connect(host="db", password="{s}")')
    s = alnum(28, "br")
    add("Bearer token in a message", s, text=f"401 Unauthorized for Authorization: Bearer {s}")
    s = alnum(12, "rd")
    add("redis URL with an empty user", s, argv=(f"--cache=redis://:{s}@cache:6379/0",))
    s = alnum(12, "lge")
    add("argv --login=user:pw", s, argv=(f"--login=svc:{s}",))
    return f


FORMS = _forms()
ENV_FORMS = [f for f in FORMS if f.env]
ARGV_FORMS = [f for f in FORMS if f.argv]
TEXT_FORMS = [f for f in FORMS if f.text]
NEEDLES = [n for f in FORMS for n in f.needles]

# What must stay as it is: arguments, variables and lines of text that name or look like secrets
# and are not (the project's false-positive guards, and detect-secrets' favourite traps).
KEPT_ARGV = [
    "--max-tokens",
    "4096",
    "--pad-token-id",
    "0",
    "--max_tokens=512",
    "--tokenizer=meta-llama/Llama-3.1-8B-Instruct",
    "--model=mistralai/Mixtral-8x7B-Instruct-v0.1",
    "--data=/data/imagenet/train/n01440764/n01440764_10026.JPEG",
    "--output_dir=./checkpoints/run_2026_12_01",
    "--rdzv-endpoint=localhost:29500",
    "--master_addr=train-job-7f9c8d6b5-x2k4p-worker-0",
    "--run-id=123e4567-e89b-42d3-a456-426614174000",
    "--user",
    "alice",
    "--passes",
    "3",
    "--session-id",
    "42",
    "--auth-type",
    "basic",
    "--prompt=The key insight: tokens are cheap",
    "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/resolve/main/config.json",
    "http://localhost:8080/metrics?job=train&rank=0",
]
KEPT_ENV = {
    "TORCHELASTIC_RUN_ID": "5c4d8b1e-9f0a-4e2b-8c3d-7a6b5c4d3e2f",
    "PYTHONPATH": "/run/rec/.agent-path:/work/main/.venv/lib/python3.11/site-packages",
    "MASTER_ADDR": "train-job-master-0.train-job.default.svc",
    "HOSTNAME": "train-job-7f9c8d6b5-x2k4p",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "NCCL_IB_PKEY": "0",
    "HF_HUB_CACHE": "/cache/huggingface/hub",
    "CONTAINER_NAME": "uid-nbfbkj-rsfkxr-cvjnfc",
    "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
    "TORCH_CUDA_ARCH_LIST": "8.0;9.0",
    "FSDP_REPLAY_POD_IMAGE": "registry.example/ml/train@sha256:" + "3f" * 32,
}
KEPT_TEXT = [
    "KeyError: 'lr'",
    "key = path[i]",
    "token = None",
    "def get(self, key: str, default: Any = None) -> Any:",
    "params = sorted(params, key=lambda t: t.numel(), reverse=True)",
    "secret = get_secret_key()",
    "session: aiohttp.ClientSession",
    "loss = model(x).sum()  # the key step",
    "RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total capacity)",
    "ValueError: expected 4096 tokens, got 4095 (max_tokens=4096)",
    "FileNotFoundError: [Errno 2] No such file or directory: '/data/imagenet/train/n01440764'",
    "connecting to localhost:29500 (rendezvous 123e4567-e89b-42d3-a456-426614174000)",
]
