"""deploy/Dockerfile, checked statically (no container engine here): multi-stage, a slim final stage
with no build tools, a numeric non-root user, the right entry point, no secrets, a tight context."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from tests.deploy.rendering import DEPLOY


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [argument for instruction, argument in self.instructions if instruction == keyword]


def _stages() -> tuple[dict[str, str], list[Stage]]:
    text = (DEPLOY / "Dockerfile").read_text(encoding="utf-8")
    logical = re.sub(r"\\\n", " ", text)
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in logical.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, argument = line.partition(" ")
        instruction, argument = instruction.upper(), argument.strip()
        if instruction == "ARG" and not stages:
            name, _, default = argument.partition("=")
            args[name] = default
        elif instruction == "FROM":
            match = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", argument, re.IGNORECASE)
            assert match is not None, argument
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], match.group(1))
            stages.append(Stage(base, match.group(2)))
        else:
            assert stages, f"{instruction} before the first FROM"
            stages[-1].instructions.append((instruction, argument))
    return args, stages


def test_dockerfile_is_multi_stage_with_a_slim_python_311_final_stage() -> None:
    _, stages = _stages()
    assert len(stages) >= 2
    builder, final = stages[0], stages[-1]
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", final.base), final.base
    # The final stage copies the virtualenv from the builder instead of building anything.
    assert any(f"--from={builder.name}" in copy for copy in final.all("COPY"))


def test_build_tools_stay_in_the_builder() -> None:
    _, stages = _stages()
    builder, final = stages[0], stages[-1]
    assert any("build-essential" in run for run in builder.all("RUN"))
    final_text = " ".join(argument for _, argument in final.instructions)
    for tool in ("gcc", "g++", "build-essential", "make ", "apt-get install", "pip install"):
        assert tool not in final_text, f"{tool!r} in the final stage"


def test_project_is_installed_without_the_embedded_extra() -> None:
    _, stages = _stages()
    installs = [run for run in stages[0].all("RUN") if "pip install" in run]
    assert installs
    assert all("embedded" not in run and "[dev]" not in run and " -e " not in run for run in installs)


def test_final_stage_runs_tokensvc_serve_as_a_numeric_non_root_user() -> None:
    _, stages = _stages()
    final = stages[-1]
    users = final.all("USER")
    assert users, "no USER in the final stage"
    user, _, group = users[-1].partition(":")
    assert user.isdigit(), f"USER {users[-1]} is not numeric"
    assert int(user) >= 10000, users[-1]
    assert not group or (group.isdigit() and int(group) != 0)
    assert json.loads(final.all("ENTRYPOINT")[-1]) == ["tokensvc"]
    assert json.loads(final.all("CMD")[-1]) == ["serve"]
    assert set(" ".join(final.all("EXPOSE")).split()) == {"50051", "9464"}


def test_no_secret_is_baked_into_the_image() -> None:
    args, stages = _stages()
    names = list(args)
    for stage in stages:
        for keyword in ("ENV", "ARG"):
            names += re.findall(r"(\w+)=", " ".join(stage.all(keyword)))
    for name in names:
        assert not re.search(r"PASSWORD|SECRET|TOKEN|API_KEY|PEPPER|PRIVATE", name, re.IGNORECASE), name
    copied = " ".join(copy for stage in stages for copy in stage.all("COPY"))
    assert ".tokensvc-dev" not in copied
    assert "secrets" not in copied


def test_build_context_is_an_allow_list_without_dev_material() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text(encoding="utf-8")
    patterns = [line.strip() for line in ignore.splitlines() if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "everything is excluded first"
    allowed = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert allowed == {"pyproject.toml", "README.md", "tokensvc"}
    assert (DEPLOY / ".dockerignore").read_text(encoding="utf-8") == ignore
