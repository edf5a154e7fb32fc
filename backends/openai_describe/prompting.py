"""Prompt building, and the description composed from the classification
alone when no LLM answer can be used."""


class PromptError(ValueError):
    """The caller's PROMPT is refused (the adapter answers INVALID_ARG)."""


def read_prompt(raw, max_chars):
    """The caller's PROMPT as text, stripped; "" when absent. Refuses bytes that
    are not UTF-8 (never guess what a caller meant, never forward U+FFFD to a
    paid model) and text longer than `max_chars` (input tokens cost money)."""
    if raw is None:
        return ""
    if isinstance(raw, (bytes, bytearray)):
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptError(f"PROMPT is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at offset "
                              f"{exc.start}); send the prompt encoded as UTF-8") from None
    else:
        text = str(raw)
    text = text.strip()
    if len(text) > max_chars:
        raise PromptError(f"PROMPT has {len(text)} characters, more than the limit "
                          f"max_prompt_chars={max_chars} (model config)")
    return text


def short_label(label):
    # ImageNet-style labels list synonyms ("tabby, tabby cat"); the first reads best.
    return label.split(",")[0].strip() or label.strip()


def format_labels(labels, scores):
    return "\n".join(f"- {label} ({score:.1%})" for label, score in zip(labels, scores))


def build_messages(settings, labels, scores, prompt):
    """The chat messages sent upstream. Labels are ranked by score first so
    the template's {top_label} and the list order never depend on the caller."""
    ranked = sorted(zip(labels, scores), key=lambda pair: -pair[1])
    labels = [label for label, _ in ranked]
    scores = [score for _, score in ranked]
    user = settings.prompt_template.format(
        prompt=prompt, labels=format_labels(labels, scores), top_label=labels[0])
    return [
        {"role": "system", "content": settings.system_prompt},
        {"role": "user", "content": user},
    ]


def fallback_description(labels, scores):
    """A plain sentence from the classification, e.g. 'Most likely a tabby
    (62%); it could also be a tiger cat (21%) or an Egyptian cat (9%).'"""
    ranked = sorted(zip(labels, scores), key=lambda pair: -pair[1])
    top, top_score = ranked[0]
    text = f"Most likely {_article(short_label(top))} ({top_score:.0%})"
    others = [f"{_article(short_label(label))} ({score:.0%})" for label, score in ranked[1:3]]
    if others:
        text += "; it could also be " + " or ".join(others)
    return text + "."


def _article(noun):
    return ("an " if noun[:1].lower() in "aeiou" else "a ") + noun
