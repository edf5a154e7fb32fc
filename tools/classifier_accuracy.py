"""How much the fast paths change the answers, on real photos the dependencies bundle.

1. int8 against fp32 (model.int8.onnx vs model.onnx, scripts/export_onnx.py): top-1
   agreement and top-5 overlap on --crops random crops/augmentations of the
   evaluation photos, which the int8 calibration never saw.
2. Reduced-scale JPEG decoding (preprocess's jpeg_draft) against the full decode: each
   evaluation photo and DRAFT_CROPS random crops of it (half its area or more), scaled
   to phone size (4032x3024, 12 MP) and to two smaller sizes, saved as JPEG, then
   classified (ONNX fp32) after both decodes.

Writes the figures as JSON (--results) and into docs/classifier-runtime.md between
its accuracy markers.

usage: python -m tools.classifier_accuracy [--crops 600] [--results docs/results/classifier-accuracy.json]
"""

import argparse
import datetime
import io
import json
import pathlib
import platform

import numpy as np

from scripts import export_onnx
from tools import docs_section, host

REPO = pathlib.Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "model_repository" / "classifier" / "1"
# Sizes the evaluation photos are scaled to for the decode comparison: a 12 MP phone
# photo (1/8 decode), 2 MP (1/4) and 0.6 MP (1/2: the shorter side is 2x-4x of 256).
PHOTO_SIZES = ((4032, 3024), (1600, 1200), (960, 640))
DRAFT_CROPS = 5


def overlap(a, b):
    """Mean share of the top-5 class names two runs have in common, per row."""
    return float(np.mean([len(set(x) & set(y)) / len(x) for x, y in zip(a, b)]))


# Not the seeds the int8 settings were chosen on (2 and 5): these crops are new to them.
EVALUATION_SEED = 11
# RandomResizedCrop's usual 8 % (heavy) and a milder 25 % (at most 2x zoom) smallest crop.
MIN_AREAS = (0.08, 0.25)


def int8_vs_fp32(count, min_area):
    pixels = export_onnx.evaluation_pixels(count, seed=EVALUATION_SEED, min_area=min_area)
    fp32_scores, fp32_labels = export_onnx.run(export_onnx.session(str(MODEL_DIR / "model.onnx")), pixels)
    _, int8_labels = export_onnx.run(export_onnx.session(str(MODEL_DIR / "model.int8.onnx")), pixels)
    changed = fp32_labels[:, 0] != int8_labels[:, 0]
    margin = fp32_scores[:, 0] - fp32_scores[:, 1]
    return {
        "crops": int(count),
        "min_crop_area": min_area,
        "seed": EVALUATION_SEED,
        "photos": list(export_onnx.EVALUATION_PHOTOS),
        "calibration_photos": list(export_onnx.CALIBRATION_PHOTOS),
        "top1_agreement": float(1 - changed.mean()),
        "top1_changed": int(changed.sum()),
        "top5_overlap": overlap(fp32_labels, int8_labels),
        # Where int8 changes the answer, fp32 itself was torn between two classes.
        "fp32_top1_minus_top2_where_changed_median": float(np.median(margin[changed])) if changed.any() else None,
        "fp32_top1_minus_top2_median": float(np.median(margin)),
    }


def draft_vs_full():
    from classify_describe_server import image_decode
    from PIL import Image
    drafted = image_decode.ImagePreprocessor(image_decode.PreprocessSettings())
    full = image_decode.ImagePreprocessor(image_decode.PreprocessSettings(jpeg_draft=False))
    sess = export_onnx.session(str(MODEL_DIR / "model.onnx"))
    rng = np.random.default_rng(EVALUATION_SEED)
    rows = []
    for name in export_onnx.EVALUATION_PHOTOS:
        photo = export_onnx.load_photo(name)
        views = [photo]
        for _ in range(DRAFT_CROPS):
            width, height = (round(side * rng.uniform(0.7, 1.0)) for side in photo.size)
            left, top = rng.integers(0, photo.width - width + 1), rng.integers(0, photo.height - height + 1)
            views.append(photo.crop((left, top, left + width, top + height)))
        for size, view in ((size, view) for size in PHOTO_SIZES for view in views):
            buffer = io.BytesIO()
            view.resize(size, Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=90)
            data = buffer.getvalue()
            a, b = drafted(data), full(data)
            (scores_a, scores_b), (labels_a, labels_b) = zip(*(export_onnx.run(sess, p[None]) for p in (a, b)))
            rows.append({
                "photo": name, "size": list(size), "decoded_size": list(drafted.decode(data).size),
                "pixels_mean_abs_diff": float(np.abs(a.astype(int) - b.astype(int)).mean()),
                "top1_same": bool(labels_a[0, 0] == labels_b[0, 0]),
                "top5_overlap": overlap(labels_a, labels_b),
                "top1_score_diff": float(abs(scores_a[0, 0] - scores_b[0, 0])),
                "top1": str(labels_b[0, 0]),
            })
    return {
        "images": len(rows),
        "top1_agreement": float(np.mean([row["top1_same"] for row in rows])),
        "top5_overlap": float(np.mean([row["top5_overlap"] for row in rows])),
        "rows": rows,
    }


def markdown(results):
    d = results["draft_vs_full"]
    lines = [
        f"Measured {results['date']} with `{results['command']}` "
        f"(onnxruntime {results['onnxruntime']}; CPU instruction sets: {host.isa_text(results.get('host'))}); "
        f"JSON: [{results['file']}]({results['file_link']}).",
        "",
        "| comparison | images | top-1 agreement | top-5 overlap |",
        "| --- | ---: | ---: | ---: |",
        *(f"| int8 vs fp32 ONNX, random crops ({q['min_crop_area']:.0%}-100 % of the area) and augmentations of "
          f"{len(q['photos'])} evaluation photos | {q['crops']} | "
          f"{q['top1_agreement']:.1%} ({q['top1_changed']} changed) | {q['top5_overlap']:.1%} |"
          for q in results["int8_vs_fp32"]),
        f"| reduced-scale vs full JPEG decode (fp32 ONNX), {len(export_onnx.EVALUATION_PHOTOS)} photos and "
        f"{DRAFT_CROPS} crops of each, at {len(PHOTO_SIZES)} sizes | {d['images']} | {d['top1_agreement']:.1%} | "
        f"{d['top5_overlap']:.1%} |",
        "",
    ]
    for q in results["int8_vs_fp32"]:
        if q["top1_changed"]:
            lines.append(
                f"- {q['min_crop_area']:.0%} crops: where int8 changed the top-1 class, fp32's own top-1 led its "
                f"runner-up by a median {q['fp32_top1_minus_top2_where_changed_median']:.3f} probability "
                f"(over all crops: {q['fp32_top1_minus_top2_median']:.3f}).")
    lines.append("")
    lines.append("Decoded sizes and the largest differences, per photo size (JPEG quality 90):")
    lines.append("")
    lines.append("| photo size | decoded at | pixels mean abs diff (max over images) | top-1 score diff (max) |")
    lines.append("| --- | --- | ---: | ---: |")
    for size in PHOTO_SIZES:
        rows = [row for row in d["rows"] if tuple(row["size"]) == size]
        decoded = {tuple(row["decoded_size"]) for row in rows}
        lines.append(f"| {size[0]}x{size[1]} | {', '.join(f'{w}x{h}' for w, h in sorted(decoded))} | "
                     f"{max(row['pixels_mean_abs_diff'] for row in rows):.2f} | "
                     f"{max(row['top1_score_diff'] for row in rows):.3f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--crops", type=int, default=600, help="evaluation crops for int8 vs fp32 (at least 500)")
    parser.add_argument("--results", type=pathlib.Path, default=REPO / "docs/results/classifier-accuracy.json")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/classifier-runtime.md")
    args = parser.parse_args(argv)

    import onnxruntime

    results = {
        "date": datetime.date.today().isoformat(),
        "command": "python -m tools.classifier_accuracy" + (f" --crops {args.crops}" if args.crops != 600 else ""),
        "onnxruntime": onnxruntime.__version__,
        "machine": platform.machine(),
        "host": host.describe(),
        "int8_vs_fp32": [int8_vs_fp32(args.crops, min_area) for min_area in MIN_AREAS],
        "draft_vs_full": draft_vs_full(),
    }
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1) + "\n")
    results["file"] = args.results.name
    results["file_link"] = f"results/{args.results.name}"
    text = markdown(results)
    if not args.no_docs:
        docs_section.replace(REPO / "docs/classifier-runtime.md", "accuracy", text)
    print(text)


if __name__ == "__main__":
    main()
