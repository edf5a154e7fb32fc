"""Replace the text between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in a docs
page, so a tool rewrites its own figures and leaves the prose around them alone."""

import pathlib


def replace(path, name, text):
    path = pathlib.Path(path)
    page = path.read_text()
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if page.count(begin) != 1 or page.count(end) != 1 or page.index(begin) > page.index(end):
        raise SystemExit(f"{path}: needs one {begin} ... {end} pair")
    head, rest = page.split(begin)
    _, tail = rest.split(end)
    path.write_text(f"{head}{begin}\n{text.strip()}\n{end}{tail}")
