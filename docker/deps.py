"""Print the project's runtime requirements from pyproject.toml, one per line, for the Docker build.

    python deps.py pyproject.toml torch        # only the torch pin (its own, cached, image layer)
    python deps.py pyproject.toml --not torch  # everything else

Reading the pins from pyproject.toml keeps one source of truth: the image installs exactly what
`pip install .` would, in two layers, so a source change does not reinstall torch.
"""

import re
import sys
import tomllib


def main(argv: list[str]) -> int:
    path, *rest = argv
    exclude = rest[:1] == ["--not"]
    names = {n.lower() for n in (rest[1:] if exclude else rest)}
    with open(path, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    for dep in deps:
        name = re.match(r"[A-Za-z0-9_.-]+", dep).group(0).lower()
        if (name in names) != exclude:
            print(dep)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
