#!/usr/bin/env bash
# Builds kvpilot's images from this checkout, pushes them to a registry you name, and prints the
# Helm values that point the chart at them. Nobody publishes kvpilot images: build your own.
#
#   scripts/build-images.sh --registry registry.example.com/ml [--tag TAG] [--images LIST]
#                           [--no-push] [--builder docker|podman] [--values-file FILE] [--dry-run]
#
# Images (from images/*.Dockerfile, context: the repository root):
#   operator     REGISTRY/operator:TAG     the operator, the router and `kvpilot fetch` (no torch)
#   engine-cuda  REGISTRY/engine:TAG       `kvpilot serve` on the PyTorch CUDA image (NVIDIA)
#   engine-rocm  REGISTRY/engine-rocm:TAG  `kvpilot serve` on the ROCm PyTorch image (AMD)
# TAG defaults to the checkout's short commit (with -dirty for uncommitted changes). The engine
# images are big (the CUDA/ROCm base images are several GB); build them where they will be pushed.
# --dry-run prints every command instead of running it (no docker needed).
set -euo pipefail
cd "$(dirname "$0")/.."

registry="" tag="" images="operator,engine-cuda,engine-rocm" push=1 builder=docker dry=0
values_file=""
die() { echo "build-images: $*" >&2; exit 2; }
while [[ $# -gt 0 ]]; do
    case "$1" in
        --registry) registry="${2:-}"; shift 2 ;;
        --tag) tag="${2:-}"; shift 2 ;;
        --images) images="${2:-}"; shift 2 ;;
        --no-push) push=0; shift ;;
        --builder) builder="${2:-}"; shift 2 ;;
        --values-file) values_file="${2:-}"; shift 2 ;;
        --dry-run) dry=1; shift ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument $1: see --help" ;;
    esac
done
[[ -n "$registry" ]] || die "--registry is required, e.g. --registry ghcr.io/your-org (where your cluster pulls from)"
registry="${registry%/}"
if [[ -z "$tag" ]]; then
    tag="$(git rev-parse --short HEAD 2>/dev/null)" || die "not a git checkout: pass --tag"
    [[ -z "$(git status --porcelain 2>/dev/null)" ]] || tag="$tag-dirty"
fi
[[ "$tag" =~ ^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$ ]] || die "--tag=$tag is not a valid image tag"

declare -A NAME=([operator]=operator [engine-cuda]=engine [engine-rocm]=engine-rocm)
IFS=, read -r -a selected <<< "$images"
for image in "${selected[@]}"; do
    [[ -n "${NAME[$image]:-}" ]] || die "--images: unknown image $image (choose from operator, engine-cuda, engine-rocm)"
done
if [[ $dry -eq 0 ]] && ! command -v "$builder" >/dev/null; then
    die "$builder is not installed: install it, pass --builder podman, or --dry-run to see the commands"
fi

# Each image's .dockerignore sits beside its Dockerfile, which only BuildKit reads.
export DOCKER_BUILDKIT=1
run() {
    if [[ $dry -eq 1 ]]; then echo "+ $*"; else echo "+ $*" >&2; "$@"; fi
}
ref() { echo "$registry/${NAME[$1]}:$tag"; }

for image in "${selected[@]}"; do
    run "$builder" build --platform linux/amd64 -f "images/$image.Dockerfile" -t "$(ref "$image")" .
done
if [[ $push -eq 1 ]]; then
    for image in "${selected[@]}"; do
        run "$builder" push "$(ref "$image")"
    done
fi

built() { [[ ",$images," == *",$1,"* ]]; }
values="# Helm values for the images scripts/build-images.sh built (tag $tag)"
if built operator; then
    values+=$'\n'"image:"$'\n'"  repository: $registry/operator"$'\n'"  tag: \"$tag\""
fi
if built engine-cuda || built engine-rocm; then
    values+=$'\n'"operator:"
    if built engine-cuda; then
        values+=$'\n'"  # Pools whose spec names no image run this one (NVIDIA)."
        values+=$'\n'"  engineImage: $(ref engine-cuda)"
    fi
    if built engine-rocm; then
        values+=$'\n'"  # AMD pools: set spec.overrides.image: $(ref engine-rocm)"
        built engine-cuda || values+=$'\n'"  engineImage: $(ref engine-rocm)"
    fi
fi
if [[ -n "$values_file" ]]; then
    printf '%s\n' "$values" > "$values_file"
fi
echo
echo "# Install the chart with these values (add imagePullSecrets if the registry is private):"
printf '%s\n' "$values"
echo "# helm install kvpilot charts/kvpilot --namespace kvpilot-system --create-namespace -f VALUES"
