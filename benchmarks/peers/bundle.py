"""The peers of benchmarks/peers.sh for a GPU host without network: vLLM as a split, checksummed archive of a
site directory, and a gpt-fast source tree.

Build it where there is network (Python 3.12 is not needed: wheels are chosen for the host's platform):

    python3 -m benchmarks.peers.bundle build --out .peers

That downloads the pins of benchmarks/peers/vllm-requirements.txt (--no-deps, binary wheels for CPython 3.12 on
manylinux x86_64) into OUT/wheels, installs them into a site directory, removes what an H100 (sm_90) running a
dense model does not load (see PRUNE), packs the rest as one reproducible tar.xz and splits it into parts under
60 MiB, part i in OUT/vllm-i/, each folder with the same MANIFEST of sha256 sums. gpt-fast goes to OUT/gpt-fast
at GPT_FAST_COMMIT (cloned, or `--gpt-fast-git-dir` archived from a local clone).

On the GPU host, with the folders carried under one PEERS_DIR:

    python3 -m benchmarks.peers.bundle install --peers-dir PEERS_DIR --target PEERS_DIR/site

checks every part and the joined archive against the manifest, unpacks it into TARGET, and prints the
PYTHONPATH entry to use. Torch, triton, transformers and numpy come from the host and are not bundled.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import lzma
import math
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REQUIREMENTS = HERE / "vllm-requirements.txt"
ARCHIVE = "vllm-site.tar.xz"
MANIFEST = "MANIFEST.sha256"
MARKER = ".bundle-sha256"  # in an unpacked site: the archive it came from
PART_MAX_BYTES = 58 * 2**20  # under 60 MiB: one transfer to the GPU host carries at most 64 MiB
PYTHON_VERSION = "3.12"
# Binary wheels only; a wheel's tags must match one of these (the host's glibc is 2.35 or newer).
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
             "manylinux_2_34_x86_64", "manylinux_2_35_x86_64")
# What an H100 running a dense Llama/Qwen model never loads (vLLM imports each of them lazily or under
# `suppress(ImportError)`), paths relative to the site directory.
PRUNE = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",  # FlashAttention 2: sm_90 runs FlashAttention 3
    "vllm/_moe_C_stable_libtorch.abi3.so",  # mixture-of-experts kernels
    "vllm/_flashmla_C.abi3.so",  # multi-head latent attention (DeepSeek)
    "vllm/_qutlass_C.abi3.so",  # microscaling fp4 quantization (Blackwell)
    "vllm/third_party/fmha_sm100",  # attention for sm_100 (Blackwell)
    "vllm/vllm-rs",  # the Rust server front end, used only with VLLM_USE_RUST_FRONTEND=1
    # DeepGEMM's extension for the other Pythons
    "vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so",
    "vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so",
)
GPT_FAST_URL = "https://github.com/pytorch-labs/gpt-fast"
GPT_FAST_COMMIT = "32971d3129541c5bfb4f715abc33d1c5f408d204"


class BundleError(Exception):
    """The bundle is incomplete or does not match its manifest."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def pip_platform_args() -> list[str]:
    args = ["--only-binary=:all:", "--python-version", PYTHON_VERSION]
    for p in PLATFORMS:
        args += ["--platform", p]
    return args


def download(requirements: Path, wheels: Path) -> None:
    """Every pinned wheel into `wheels` (already there: not fetched again)."""
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", *pip_platform_args(), "-d", str(wheels),
                    "-r", str(requirements)], check=True)


def install_site(requirements: Path, wheels: Path, site: Path) -> None:
    """The pinned wheels of `wheels` unpacked into `site` as the host's Python 3.12 would install them."""
    if site.exists():
        shutil.rmtree(site)
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile",
                    "--find-links", str(wheels), "--target", str(site), *pip_platform_args(),
                    "-r", str(requirements)], check=True)


def prune(site: Path, paths: Iterable[str] = PRUNE) -> int:
    """Remove `paths` (files or folders) from `site`; the bytes removed. A path that is absent is an error: the
    wheel changed, and the list must be looked at again."""
    removed = 0
    for rel in paths:
        target = site / rel
        if target.is_dir():
            removed += sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
            shutil.rmtree(target)
        elif target.is_file():
            removed += target.stat().st_size
            target.unlink()
        else:
            raise BundleError(f"nothing to prune at {rel} in {site}: the wheel's layout changed; review PRUNE")
    return removed


def pack(site: Path, archive: Path) -> None:
    """`site` as a tar.xz whose bytes depend only on the files (sorted names, no owners, fixed times)."""

    def normal(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 0
        return info

    files = sorted(p for p in site.rglob("*") if p.is_file() or p.is_symlink())
    with lzma.open(archive, "wb", preset=9) as xz, tarfile.open(fileobj=xz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in files:
            tar.add(path, arcname=path.relative_to(site).as_posix(), recursive=False, filter=normal)


def split(archive: Path, out: Path, part_max: int = PART_MAX_BYTES) -> list[Path]:
    """Cut `archive` into equal parts of at most `part_max` bytes, part i as out/vllm-i/ARCHIVE.i, and write the
    manifest (each part's sha256 and the whole archive's) into every part's folder."""
    size = archive.stat().st_size
    count = max(1, math.ceil(size / part_max))
    part_size = math.ceil(size / count)
    parts = []
    with archive.open("rb") as src:
        for i in range(1, count + 1):
            folder = out / f"vllm-{i}"
            if folder.exists():
                shutil.rmtree(folder)
            folder.mkdir(parents=True)
            part = folder / f"{archive.name}.{i}"
            part.write_bytes(src.read(part_size))
            parts.append(part)
    lines = [f"{sha256_of(p)}  {p.relative_to(out).as_posix()}" for p in parts]
    lines.append(f"{sha256_of(archive)}  {archive.name}")
    for p in parts:
        (p.parent / MANIFEST).write_text("\n".join(lines) + "\n")
    return parts


def read_manifest(peers_dir: Path) -> tuple[list[tuple[str, str]], str]:
    """(part path, sha256) of every part in order, and the joined archive's sha256, from the first vllm-*/MANIFEST
    under `peers_dir`."""
    manifests = sorted(peers_dir.glob(f"vllm-*/{MANIFEST}"))
    if not manifests:
        raise BundleError(f"no vllm-*/{MANIFEST} under {peers_dir}: carry the folders vllm-1, vllm-2, ... that "
                          "`python3 -m benchmarks.peers.bundle build` wrote there")
    parts, whole = [], None
    for line in manifests[0].read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        digest, name = line.split(maxsplit=1)
        if name == ARCHIVE:
            whole = digest
        else:
            parts.append((name, digest))
    if whole is None or not parts:
        raise BundleError(f"{manifests[0]} lists no parts or no {ARCHIVE}: rebuild the bundle")
    return parts, whole


def verify_and_join(peers_dir: Path, archive: Path) -> str:
    """Check every part against the manifest, join them into `archive`, check the whole; its sha256."""
    parts, whole = read_manifest(peers_dir)
    for name, digest in parts:
        path = peers_dir / name
        if not path.is_file():
            raise BundleError(f"part {name} is missing under {peers_dir}: carry every vllm-* folder of the bundle")
        got = sha256_of(path)
        if got != digest:
            raise BundleError(f"part {name} is corrupt: sha256 {got}, the manifest says {digest}; carry it again")
    with archive.open("wb") as dst:
        for name, _ in parts:
            with (peers_dir / name).open("rb") as src:
                shutil.copyfileobj(src, dst, 2**20)
    got = sha256_of(archive)
    if got != whole:
        raise BundleError(f"the joined archive's sha256 is {got}, the manifest says {whole}: the parts do not belong "
                          "to one bundle; carry them again from one build")
    return got


def install(peers_dir: Path, target: Path) -> Path:
    """Unpack the bundle under `peers_dir` into `target` (skipped when `target` already holds this bundle)."""
    _, whole = read_manifest(peers_dir)
    marker = target / MARKER
    if marker.is_file() and marker.read_text().strip() == whole:
        return target
    with tempfile.TemporaryDirectory(dir=peers_dir) as tmp:
        archive = Path(tmp) / ARCHIVE
        verify_and_join(peers_dir, archive)
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        with tarfile.open(archive, "r:xz") as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(target, filter="data")
            else:  # Python < 3.11.4: the archive is ours and holds plain files only
                tar.extractall(target)
    marker.write_text(whole + "\n")
    return target


def gpt_fast(dest: Path, git_dir: Path | None) -> None:
    """gpt-fast at GPT_FAST_COMMIT into `dest`: archived from a local clone's git directory, else cloned."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    if git_dir is not None:
        tar_bytes = subprocess.run(["git", f"--git-dir={git_dir}", "archive", GPT_FAST_COMMIT], check=True,
                                   capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, filter="data")
            else:
                tar.extractall(dest)
    else:
        subprocess.run(["git", "clone", "-q", GPT_FAST_URL, str(dest)], check=True)
        subprocess.run(["git", "-C", str(dest), "checkout", "-q", GPT_FAST_COMMIT], check=True)


def build(out: Path, gpt_fast_git_dir: Path | None) -> list[Path]:
    wheels, site = out / "wheels", out / "build-site"
    download(REQUIREMENTS, wheels)
    install_site(REQUIREMENTS, wheels, site)
    removed = prune(site)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        archive = Path(tmp) / ARCHIVE
        pack(site, archive)
        parts = split(archive, out)
    shutil.rmtree(site)
    gpt_fast(out / "gpt-fast", gpt_fast_git_dir)
    print(f"pruned {removed / 2**20:.0f} MiB; gpt-fast {GPT_FAST_COMMIT}")
    for p in parts:
        print(f"{p.stat().st_size / 2**20:6.1f} MiB  {sha256_of(p)}  {p}")
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.peers.bundle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download, prune, pack and split vLLM; fetch gpt-fast")
    b.add_argument("--out", type=Path, default=Path(".peers"))
    b.add_argument("--gpt-fast-git-dir", type=Path, default=None,
                   help="a local clone's git directory to archive gpt-fast from (default: clone it)")
    i = sub.add_parser("install", help="check the parts, join them and unpack the site directory")
    i.add_argument("--peers-dir", type=Path, default=Path(".peers"))
    i.add_argument("--target", type=Path, default=None, help="default: PEERS_DIR/site")
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            build(args.out, args.gpt_fast_git_dir)
        else:
            site = install(args.peers_dir, args.target or args.peers_dir / "site")
            print(f"vLLM unpacked; put {site.resolve()} on PYTHONPATH")
    except BundleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
