#!/usr/bin/env bash
# A cosmic-ray mutation run (a well-kept mutation tool) over one module, in a throwaway copy of
# the repository, with the targeted tests of scripts/mutation/cosmic_ray/<name>.toml:
#
#   pip install cosmic-ray==8.7.0                     # once; not a CI dependency (a run takes ~30 min per module)
#   scripts/mutation/run_cosmic_ray.sh sampling       # data/sampling.py: about 320 mutants, ~6 s each on 2 cores
#   scripts/mutation/run_cosmic_ray.sh lit            # also: perplexity, masks, reference, cache, tokenizers (reduced and sampled)
#
# After cosmic-ray's init, filters mark mutants as skipped: cosmic-ray's operators-filter (the
# config's `[cosmic-ray.filters.operators-filter] exclude-operators`, a reduced operator set), its
# line-filter where the config has `[cosmic-ray.filters.line-filter]` (the lines to mutate), and
# scripts/mutation/cosmic_ray/filters.py (mutants inside annotations or f-strings; a seeded sample where the
# config asks for one). Prints cosmic-ray's report (every surviving mutant with its diff) and the
# score without the skipped mutants (scripts/mutation/cosmic_ray/score.py); the session database stays in
# the copy, whose path is printed. Survivors worth a test are listed in
# docs/results/mutation_check.md; scripts/mutation/check_planted_mutations.py is the fast, curated check.
set -euo pipefail
name=${1:?usage: scripts/mutation/run_cosmic_ray.sh NAME (a scripts/mutation/cosmic_ray/NAME.toml)}
root=$(cd "$(dirname "$0")/../.." && pwd)
config=$root/scripts/mutation/cosmic_ray/$name.toml
[ -f "$config" ] || { echo "no $config"; exit 2; }
work=$(mktemp -d /tmp/cosmic_ray_"$name".XXXXXX)
git -C "$root" ls-files --cached --others --exclude-standard -z | (cd "$root" && xargs -0 cp --parents -t "$work")
cd "$work"
# the copy's modules first: cosmic-ray mutates them in place, and attnlab may be installed from elsewhere
export PYTHONPATH=$work ATTNLAB_CACHE_DIR=${ATTNLAB_CACHE_DIR:-$work/.cache}
cosmic-ray init "$config" session.sqlite
cr-filter-operators session.sqlite "$config"
if grep -q '^\[cosmic-ray.filters.line-filter\]' "$config"; then  # only the configured lines (cosmic-ray's filter)
  cr-filter-lines --config "$config" session.sqlite
fi
python "$work/scripts/mutation/cosmic_ray/filters.py" session.sqlite "$config"
cosmic-ray baseline "$config"   # the unmutated code must pass the selection
cosmic-ray exec "$config" session.sqlite
cr-report session.sqlite --show-diff --surviving-only
python "$work/scripts/mutation/cosmic_ray/score.py" session.sqlite
echo "session: $work/session.sqlite"
