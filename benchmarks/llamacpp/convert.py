#!/usr/bin/env python
"""Convert an HF checkpoint to an f32 GGUF for llama.cpp with its own convert_hf_to_gguf.py.

    python benchmarks/llamacpp/convert.py models/default/target             # -> the cache, path printed
    python benchmarks/llamacpp/convert.py models/default/draft --out draft.gguf

The converter recognises a BPE pre-tokenizer by hashing how it splits a test string, and a tokenizer
trained here is in no list. A byte-level BPE whose pre-tokenizer is HF's ByteLevel(use_regex=True)
splits with GPT-2's regex, which is llama.cpp's "gpt-2" pre-tokenizer, so that is what goes into
tokenizer.ggml.pre: the converter's get_vocab_base_pre is replaced in this process, and the vendored
file stays as shipped. Any other pre-tokenizer is refused. Needs torch, transformers, numpy, pyyaml
and tqdm (all in the project's venv); gguf comes from the llama.cpp tree.

The llama.cpp source (for convert_hf_to_gguf.py and its gguf-py) is $LLAMACPP_SRC, else the one the
build in $LLAMACPP_BUILD (benchmarks/llamacpp/build.sh) was configured from. compare.py calls
gguf_for() to convert on first use; the GGUF is redone when the weights change.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

CACHE = Path(os.environ.get("SPECD_CACHE", Path.home() / ".cache" / "specd"))
BUILD = Path(os.environ.get("LLAMACPP_BUILD", CACHE / "llama.cpp"))
PRE_TOKENIZER = "gpt-2"


def server_binary() -> Path:
    return Path(os.environ.get("LLAMA_SERVER", BUILD / "bin" / "llama-server"))


def source_dir() -> Path:
    """llama.cpp's source tree: $LLAMACPP_SRC (an unpacked llama-cpp-python sdist or llama.cpp
    itself), else the tree the build directory was configured from."""
    if "LLAMACPP_SRC" in os.environ:
        src = Path(os.environ["LLAMACPP_SRC"])
    else:
        cache = BUILD / "CMakeCache.txt"
        homes = [ln.split("=", 1)[1] for ln in cache.read_text().splitlines()
                 if ln.startswith("CMAKE_HOME_DIRECTORY:")] if cache.exists() else []
        if not homes:
            raise FileNotFoundError(f"no llama.cpp source: set LLAMACPP_SRC or run benchmarks/llamacpp/build.sh "
                                    f"(looked for {cache})")
        src = Path(homes[0])
    if (src / "vendor" / "llama.cpp").is_dir():
        src = src / "vendor" / "llama.cpp"
    if not (src / "convert_hf_to_gguf.py").exists():
        raise FileNotFoundError(f"no convert_hf_to_gguf.py in {src}")
    return src


def check_pre_tokenizer(model_dir: Path) -> None:
    pre = json.loads((model_dir / "tokenizer.json").read_text()).get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise ValueError(f"{model_dir}: pre-tokenizer {pre.get('type')!r} is not GPT-2's byte-level split; "
                         f"{PRE_TOKENIZER!r} would tokenize differently")


def gguf_for(model_dir: str | Path) -> Path:
    """The f32 GGUF of model_dir in the cache, converted now if absent or older than the weights."""
    model_dir = Path(model_dir).resolve()
    weights = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.bin"))
    stamp = "|".join(f"{w.name}:{w.stat().st_size}:{w.stat().st_mtime_ns}" for w in weights)
    key = hashlib.sha256(f"{model_dir}|{stamp}".encode()).hexdigest()[:12]
    out = CACHE / "gguf" / f"{model_dir.parent.name}-{model_dir.name}-{key}-f32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"converting {model_dir} -> {out}", flush=True)
        subprocess.run([sys.executable, __file__, str(model_dir), "--out", str(out)], check=True)
    return out


def convert(model_dir: Path, out: Path) -> None:
    check_pre_tokenizer(model_dir)
    src = source_dir()
    sys.path[:0] = [str(src), str(src / "gguf-py")]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    def no_sentencepiece(self: TextModel) -> None:
        raise FileNotFoundError("a byte-level BPE has no tokenizer.model")

    # LlamaModel.set_vocab tries SentencePiece first, which needs the sentencepiece package only to
    # find no tokenizer.model; without that attempt it reaches the BPE (GPT-2 style) vocab directly.
    TextModel._set_vocab_sentencepiece = no_sentencepiece
    TextModel.get_vocab_base_pre = lambda self, tokenizer: PRE_TOKENIZER
    sys.argv = ["convert_hf_to_gguf.py", str(model_dir), "--outtype", "f32", "--outfile", str(out)]
    convert_hf_to_gguf.main()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="HF checkpoint directory")
    ap.add_argument("--out", type=Path, help="the GGUF to write (default: the cache, which compare.py reads)")
    args = ap.parse_args()
    if args.out is None:
        print(gguf_for(args.model))
    else:
        convert(args.model.resolve(), args.out)


if __name__ == "__main__":
    main()
