#!/usr/bin/env bash
# A file larger than one device call may carry travels in two parts, one per call (docs/gpu.md):
#   gpu_two_part.sh split FILE PART1_BYTES DIR1 DIR2   here: FILE's first PART1_BYTES into DIR1/NAME.part1,
#                                                      the rest into DIR2/NAME.part2, and into both dirs the
#                                                      manifest NAME.parts.sha256 (each part's sha256 and the
#                                                      whole file's, as sha256sum writes them)
#   gpu_two_part.sh check DIR1                         there, call 1: every part 1 in DIR1 is whole
#   gpu_two_part.sh join DIR1 DIR2 OUTDIR              there, call 2: both parts checked, joined into
#                                                      OUTDIR/NAME, the whole file checked against the manifest
# Between the calls part 1 waits under the ignored device_carry/ on the machine, which keeps files
# there while it is held (it is given back 30 s after a call ends: make call 2 at once).
set -euo pipefail

die() { echo "gpu_two_part.sh: $*" >&2; exit 2; }

# the sha256 the manifest records for FILE (a name in it), or nothing
recorded() { awk -v f="$2" '$2 == f { print $1 }' "$1"; }

verify() {  # verify MANIFEST DIR FILE: DIR/FILE is there and has the recorded sha256
    local manifest=$1 dir=$2 file=$3 want got
    want=$(recorded "$manifest" "$file")
    [[ -n "$want" ]] || die "$manifest records no sha256 for $file"
    [[ -f "$dir/$file" ]] || return 3
    got=$(sha256sum "$dir/$file" | cut -d' ' -f1)
    [[ "$got" == "$want" ]] || die "$dir/$file has sha256 $got, the manifest $manifest says $want: it was cut short or changed on the way; build it again (benchmarks/gpu_carry.sh) and make both calls again"
}

missing_part1() {  # missing_part1 DIR1 FILE
    die "$1/$2 is missing: call 1 (carry $1) did not reach this machine, or the machine was given back between the calls (it stays warm 30 s after one); make call 1 again, then call 2 at once"
}

manifests() {  # MANIFESTS=(the manifests in DIR), at least one
    shopt -s nullglob
    MANIFESTS=("$1"/*.parts.sha256)
    shopt -u nullglob
    (( ${#MANIFESTS[@]} )) || die "$1 holds no *.parts.sha256 manifest: was it made by benchmarks/gpu_carry.sh?"
}

cmd=${1:-}
case "$cmd" in
split)
    [[ $# -eq 5 ]] || die "usage: gpu_two_part.sh split FILE PART1_BYTES DIR1 DIR2"
    file=$2 first=$3 dir1=$4 dir2=$5
    [[ -f "$file" ]] || die "$file: no such file"
    size=$(stat -c %s "$file")
    (( first > 0 && first < size )) || die "PART1_BYTES must be between 1 and $((size - 1)) for $file ($size bytes)"
    name=$(basename "$file")
    mkdir -p "$dir1" "$dir2"
    head -c "$first" "$file" > "$dir1/$name.part1"
    tail -c +"$((first + 1))" "$file" > "$dir2/$name.part2"
    {
        sha256sum "$dir1/$name.part1" | awk -v f="$name.part1" '{ print $1 "  " f }'
        sha256sum "$dir2/$name.part2" | awk -v f="$name.part2" '{ print $1 "  " f }'
        sha256sum "$file" | awk -v f="$name" '{ print $1 "  " f }'
    } > "$dir1/$name.parts.sha256"
    cp "$dir1/$name.parts.sha256" "$dir2/$name.parts.sha256"
    echo "$name: part 1 $first bytes in $dir1, part 2 $((size - first)) bytes in $dir2"
    ;;
check)
    [[ $# -eq 2 ]] || die "usage: gpu_two_part.sh check DIR1"
    dir1=$2
    [[ -d "$dir1" ]] || die "$dir1: no such directory: call 1 must carry it"
    manifests "$dir1"
    for manifest in "${MANIFESTS[@]}"; do
        name=$(basename "$manifest" .parts.sha256)
        verify "$manifest" "$dir1" "$name.part1" || missing_part1 "$dir1" "$name.part1"
        echo "$name.part1: whole ($(stat -c %s "$dir1/$name.part1") bytes)"
    done
    ;;
join)
    [[ $# -eq 4 ]] || die "usage: gpu_two_part.sh join DIR1 DIR2 OUTDIR"
    dir1=$2 dir2=$3 out=$4
    [[ -d "$dir2" ]] || die "$dir2: no such directory: call 2 must carry it"
    mkdir -p "$out"
    manifests "$dir2"
    for manifest in "${MANIFESTS[@]}"; do
        name=$(basename "$manifest" .parts.sha256)
        [[ -f "$dir1/$name.parts.sha256" ]] || missing_part1 "$dir1" "$name.parts.sha256"
        cmp -s "$manifest" "$dir1/$name.parts.sha256" \
            || die "$dir1/$name.parts.sha256 differs from $manifest: call 1 carried another build's part 1; make both calls again"
        verify "$manifest" "$dir1" "$name.part1" || missing_part1 "$dir1" "$name.part1"
        verify "$manifest" "$dir2" "$name.part2" || die "$dir2/$name.part2 is missing: call 2 must carry $dir2 whole"
        cat "$dir1/$name.part1" "$dir2/$name.part2" > "$out/$name.joining"
        mv "$out/$name.joining" "$out/$name"
        verify "$manifest" "$out" "$name"
        echo "$name: joined and checked ($(stat -c %s "$out/$name") bytes)"
    done
    ;;
*)
    die "usage: gpu_two_part.sh split FILE PART1_BYTES DIR1 DIR2 | check DIR1 | join DIR1 DIR2 OUTDIR"
    ;;
esac
