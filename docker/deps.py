"""Print the project's runtime requirements from pyproject.toml, one per line, for the Docker build.

    python deps.py pyproject.toml torch        # only the torch pin (its own, cached, image layer)
    python deps.py pyproject.toml --not torch  # everything else
    python deps.py pyproject.toml --gateway    # the gateway image's: [tool.pdserve] gateway-dependencies

Reading the pins from pyproject.toml keeps one source of truth: the image installs exactly what
`pip install .` would, in two layers, so a source change does not reinstall torch. The gateway's image
installs only the distributions its list names (with [project] dependencies' pins) and pdserve itself with
--no-deps: no torch.
"""

import re
import sys
import tomllib


def _name(dep: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", dep).group(0).lower()


def main(argv: list[str]) -> int:
    path, *rest = argv
    with open(path, "rb") as f:
        project = tomllib.load(f)
    deps = project["project"]["dependencies"]
    if rest == ["--gateway"]:
        wanted = {n.lower() for n in project["tool"]["pdserve"]["gateway-dependencies"]}
        missing = wanted - {_name(dep) for dep in deps}
        if missing:  # a name without a pin in [project] dependencies: the image would not be what pip installs
            print(f"not in [project] dependencies: {', '.join(sorted(missing))}", file=sys.stderr)
            return 1
        print("\n".join(dep for dep in deps if _name(dep) in wanted))
        return 0
    exclude = rest[:1] == ["--not"]
    names = {n.lower() for n in (rest[1:] if exclude else rest)}
    for dep in deps:
        if (_name(dep) in names) != exclude:
            print(dep)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
