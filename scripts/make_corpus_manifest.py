"""Write data/corpus_manifest.json from several CPython standard libraries.

    python scripts/make_corpus_manifest.py "3.11.7 pyenv=/usr/lib/python3.11" \\
        "3.13.2 pyodide 0.29.3=python_stdlib.zip" ... --out data/corpus_manifest.json

Each argument is LABEL=PATH, PATH a standard library directory (the one holding os.py) or a
zip of one (Pyodide's python_stdlib.zip). The first one gives the order of the chunks. The
manifest pins, per module and per pydoc topic, the chunks that are byte-identical in every
library given (see data/manifest.py), leaving out the parts distributions strip. Give it
every supported minor version, in more than one packaging, so that what it pins does not
depend on one build. The labels are recorded in the manifest's `sources`.
"""
from __future__ import annotations

import argparse
import zipfile
from pathlib import Path, PurePosixPath

from data.manifest import MANIFEST_PATH, TOPICS_FILE, CorpusPart, Manifest, is_stripped, read_topics
from scripts.refuse import refuse


class Library:
    """The .py files of one standard library, from a directory or a zip."""

    def __init__(self, path: Path) -> None:
        self.files: dict[str, bytes] = {}
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                for name in z.namelist():
                    if name.endswith(".py"):
                        self.files[PurePosixPath(name).as_posix()] = z.read(name)
        else:
            for file in path.rglob("*.py"):
                if file.is_file():
                    self.files[file.relative_to(path).as_posix()] = file.read_bytes()
        if "os.py" not in self.files:
            refuse(f"{path}: no os.py, so not a standard library")

    def modules(self) -> dict[str, str]:
        texts = {}
        for rel, data in self.files.items():
            if is_stripped(rel):
                continue
            try:
                texts[rel] = data.decode("utf-8")
            except UnicodeDecodeError:
                continue  # a legacy-encoded fixture: no text all interpreters read alike
        return texts

    def topics(self) -> dict[str, str]:
        if TOPICS_FILE not in self.files:
            return {}
        return read_topics(self.files[TOPICS_FILE], TOPICS_FILE)


def shared(per_library: list[dict[str, str]]) -> dict[str, list[str]]:
    """Documents present in every library, each with its text in each (the first library first)."""
    names = set(per_library[0]).intersection(*per_library[1:])
    return {name: [docs[name] for docs in per_library] for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("libraries", nargs="+", help="LABEL=PATH, PATH a stdlib directory or zip")
    parser.add_argument("--out", type=Path, default=MANIFEST_PATH)
    args = parser.parse_args()

    labels, libraries = [], []
    for arg in args.libraries:
        label, sep, path = arg.rpartition("=")
        if not sep or not label:
            refuse(f"{arg!r}: expected LABEL=PATH")
        labels.append(label)
        libraries.append(Library(Path(path).expanduser()))
    with_topics = [lib.topics() for lib in libraries]
    with_topics = [t for t in with_topics if t]
    if not with_topics:
        refuse(f"no library has {TOPICS_FILE}")

    manifest = Manifest(
        stdlib=CorpusPart.common("code", shared([lib.modules() for lib in libraries])),
        pydoc_topics=CorpusPart.common("prose", shared(with_topics)),
        sources=labels,
    )
    args.out.write_text(manifest.to_json(), encoding="utf-8")
    for name, part in (("stdlib", manifest.stdlib), ("pydoc_topics", manifest.pydoc_topics)):
        n_chunks = sum(len(keys) for keys in part.documents.values())
        print(f"{name}: {len(part.documents)} documents, {n_chunks} chunks, {part.size_bytes:,} bytes")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
