"""``kvguard demo``: the incident on a local CPU PD deployment, without and with kvguard.

Brings up real SGLang prefill + decode servers and sglang-router on 127.0.0.1 with a
tiny locally generated model and the incident's geometry scaled down (context 1024
tokens, prefill pool 256, decode pool 2048), sends a prompt that fits and the
incident's over-capacity prompt, then does the same with kvguard, and prints what
each deployment answered. Exit status 0 when the guarded deployment never answered
200 to the over-capacity prompt, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Optional

CONTEXT = 1024
PREFILL_POOL = 256
DECODE_POOL = 2048
VOCAB = 256
FIT = 40
OVER = 600


def _cpu_shim_dirs() -> List[Path]:
    """The repository's test-side CPU shim (needed on 0.5.23's prefill), if present."""
    repo = Path(__file__).resolve().parents[2]
    shim = repo / "tests" / "server" / "cpu_shim"
    return [shim] if shim.is_dir() else []


def _describe(r) -> str:
    if not r.status:
        return f"no answer within {r.elapsed:.0f} s ({r.error})"
    s = f"HTTP {r.status} in {r.elapsed:.1f} s"
    if r.status == 200 and isinstance(r.json, dict):
        meta = r.json.get("meta_info", {})
        s += f", prompt_tokens={meta.get('prompt_tokens')}, text={r.json.get('text', '')[:40]!r}"
    else:
        body = r.text or ""
        try:
            body = json.loads(body).get("error", {}).get("message", body)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001
            pass
        s += f": {str(body)[:160]}"
    return s


def _run(name: str, launcher: str, model: Path, log_dir: Path, timeout: float, plugins, extra=()) -> Dict[str, object]:
    from .deployment import DeploymentError, PDDeployment
    from .tinymodel import prompt_of_tokens

    env = {"KVGUARD_AUTO_INSTALL": "0"}
    shim = _cpu_shim_dirs()
    print(f"[{name}] starting prefill + decode + router ({launcher} {' '.join(extra)}) ...", flush=True)
    d = PDDeployment(
        model,
        log_dir=log_dir / name,
        launcher=launcher,
        prefill_max_total_tokens=PREFILL_POOL,
        decode_max_total_tokens=DECODE_POOL,
        context_length=CONTEXT,
        env=env,
        extra_pythonpath=shim,
        sglang_plugins=(["kvguard_test_cpu_shim"] if shim else []) + list(plugins),
        prefill_extra_args=list(extra),
        decode_extra_args=list(extra),
    )
    try:
        d.start()
    except DeploymentError as exc:
        d.stop()
        reason = next((l for l in str(exc).splitlines() if "kvguard pool check" in l), str(exc).splitlines()[0])
        reason = reason.split("ERROR ", 1)[-1].strip()
        return {"refused": reason[:600], "release": d.release.version if d.release else "?"}
    try:
        fit = d.generate(prompt_of_tokens(FIT, vocab=VOCAB), max_new_tokens=8)
        over = d.generate(prompt_of_tokens(OVER, vocab=VOCAB, offset=17), max_new_tokens=8, timeout=timeout)
        return {"fit": fit, "over": over, "release": d.release.version if d.release else "?"}
    finally:
        d.stop()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="kvguard demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log-dir", default=None, help="where server logs go (default: a temp dir)")
    ap.add_argument("--timeout", type=float, default=30.0, help="client timeout for the over-capacity request (s)")
    ap.add_argument("--only", choices=("unguarded", "guarded", "guarded-warn"), default=None, help="run one part only")
    args = ap.parse_args(argv)

    from .tinymodel import make_tiny_model

    work = Path(args.log_dir or tempfile.mkdtemp(prefix="kvguard-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(work / "tiny-llama", context_length=CONTEXT, vocab=VOCAB)
    print(f"kvguard demo: context {CONTEXT} tokens, prefill pool {PREFILL_POOL}, decode pool {DECODE_POOL}; "
          f"prompts of {FIT} (fits) and {OVER} tokens (over prefill's capacity); logs in {work}")
    results = {}
    if args.only in (None, "unguarded"):
        results["unguarded SGLang"] = _run("unguarded", "sglang.launch_server", model, work, args.timeout, [])
    if args.only in (None, "guarded"):
        results["with kvguard (defaults)"] = _run("guarded", "sglang_kvguard.launch_server", model, work, args.timeout, [])
    if args.only in (None, "guarded-warn"):
        results["with kvguard, pool check relaxed to warn"] = _run(
            "guarded-warn", "sglang_kvguard.launch_server", model, work, args.timeout, [],
            extra=("--kvguard-pool-policy", "warn"))
    print()
    failed = False
    for name, r in results.items():
        print(f"{name} (SGLang {r['release']}):")
        if "refused" in r:
            print(f"  the deployment did not start: {r['refused']}")
            continue
        print(f"  fitting prompt ({FIT} tokens):       {_describe(r['fit'])}")
        print(f"  over-capacity prompt ({OVER} tokens): {_describe(r['over'])}")
        if name != "unguarded SGLang" and r["over"].status == 200:
            failed = True
    if failed:
        print("\nFAIL: a guarded deployment answered 200 to a prompt its prefill pool cannot hold")
        return 1
    print("\nOK: with kvguard no over-capacity prompt was answered with HTTP 200 over another request's KV")
    return 0


if __name__ == "__main__":
    sys.exit(main())
