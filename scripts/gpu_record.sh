#!/usr/bin/env bash
# The GPU record in named sections, each well inside one 10-minute device call, each writing its
# reports (JSON + Markdown) under r/ as it finishes, with the GPU and the commit in r/run.txt, and
# packing r/, logs/ and steps.txt into $OUT/record.tgz after every step (a device call returns at
# most 8 files: a run's loose reports and logs were left behind):
#
#   TREE=abc1234 bash scripts/gpu_record.sh gputests memory   # sections in the order given
#   tar xzf record.tgz                                # where the files came back
#
# Carry .whl (scripts/device_wheels.sh fills it; cpu16 wants .whl-cpu, benchmarks/README.md) and
# put what comes back under r/ into benchmarks/ with scripts/nest_report.py (a rerun in place of its
# report, a variant as a section: corpora's as encode_corpus_24khz_h100's orpheus_rows_vs_notebook,
# serve16's as serve_cpu_24khz's sixteen_cores_forms, cpu16's as cpu_stream_24khz_2core's
# sixteen_cores: benchmarks/README.md).
# Sections, in the order the record wants them:
#   gputests    every gpu test (the CPU suite is CI's)
#   memory      the README recipe by phase; the budget's cost at 1 / 1.5 / 2 GB
#   coloc       an LM stand-in holding 90% of the card beside serve: default, then MPS
#   formats     256 mp3 and pcm streams, 4 workers; then mp3 with 8
#   first       time to first audio: 1 / 64 / 256 clients, Poisson and burst, by part
#   first256    time to first audio at 256 Poisson clients alone, three rounds (the LM request's parts)
#   text        256 text WebSockets (staggered, then Poisson); long text at the LM's 3x
#   soak_start  a 10-minute soak at 256 streams (10% disconnects, LM faults) in a process of its own
#               session that outlives the call: run other sections, then soak_collect within 30 minutes
#   soak_collect  waits for the soak and copies its report
#   corpora     encode-dataset --format orpheus against Unsloth's notebook pipeline (WHEELS=.whl-corpora:
#               scripts/device_wheels.sh corpora)
#   cpu16       CPU streams on the host's 16 cores (WHEELS=.whl-cpu)
#   serve16     serve --device cpu on the host's 16 cores: workers and threads four ways
#   ab          the formats' load on an older package and this one, old / new / old / new, then 256 text
#               WebSockets old / new, all measured by this tree's bench script (AB_TREE=.ab/REV,
#               carried beside .whl: bash scripts/ab_tree.sh REV;
#               9409443, the tree before the model presets, covers everything since the H100 record of 1907f54;
#               AB_NEW=.ab/REV2 puts an archived tree in this one's place: AB_TREE=.ab/9409443 AB_NEW=.ab/1851d0f
#               is the presets' commit alone)
#               AB_KEYS picks runs (default: old new old2 new2 textws_old textws_new new_asyncio)
#   levers      serve's GPU-memory levers alone and together (the recipe by phase)
#   compress    256 text WebSockets with the clients' per-message deflate accepted (--ws-compression) and
#               declined (the default), interleaved accept / decline / accept / decline
#   slices      the README recipe by phase, its steps whole and in slices of 128 and 64 rows (--rows-per-pass),
#               a fresh process each, interleaved (SLICE_KEYS picks)
#   trim        the formats' load with serve's --memory-trim default and with 0 (none), interleaved
set -u
cd "$(dirname "$0")/.."
: "${OUT:?set OUT, the folder whose files come back}"
R=/tmp/gpu_record  # this call's files, packed into $OUT/record.tgz
rm -rf "$R" && mkdir -p "$R/r" "$R/logs"
pack() { tar czf "$OUT/record.tgz.part" -C "$R" . && mv "$OUT/record.tgz.part" "$OUT/record.tgz"; }
. scripts/device_setup.sh > "$R/logs/setup.log" 2>&1 || { echo "setup failed"; tail "$R/logs/setup.log"; pack; exit 1; }
# TREE: the commit as the caller names it (TREE=$(git rev-parse --short HEAD) on the calling side); the
# device copy's own git HEAD has lagged the files it carried
echo "${TREE:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown) (HEAD of the copy)} $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) $(date -u +%F)" \
  | tee "$R/r/run.txt"
# where the event loop comes from: the carried wheel (/tmp/site) or the image
python -c "import uvloop; print('uvloop', uvloop.__version__, uvloop.__file__)" >> "$R/r/run.txt" 2>&1 || echo "no uvloop" >> "$R/r/run.txt"
# (a later --workers N overrides C's: argparse keeps an option's last value)
C="--workers 4 --shared-engine --max-streams 2048 --max-batch 512 --lm-workers 4 --client-procs 4"

step() {  # step NAME SECONDS COMMAND...: its log in logs/, its status and time in steps.txt
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$R/logs/$name.log" 2>&1
  echo "$name rc=$? $(( $(date +%s) - t0 ))s" | tee -a "$R/steps.txt"
  tail -4 "$R/logs/$name.log"
  pack
}

for section in "$@"; do
  case $section in
    # test_schema.py holds no gpu test and imports schemathesis, which the GPU machine lacks
    gputests) step gputests 540 python -m pytest -q -n 8 -m gpu tests -p no:cacheprovider -rs --ignore tests/serve/test_schema.py ;;
    memory)
      step recipe 150 python scripts/profile_memory.py --out "$R/r" --stem memory_recipe_24khz
      step budget 300 python scripts/bench_budget.py --budgets 1,1.5,2,0 --max-streams 1024 --out "$R/r" ;;
    coloc)
      CO="--clients 64,256 --seconds 12 --format pcm --colocated-lm 0.9 --lm-idle-s 5 --workers 4 --shared-engine \
          --max-streams 1024 --max-batch 256 --lm-workers 4 --client-procs 4 --out $R/r --stem colocated_24khz"
      step coloc 250 python scripts/bench_serve_http.py $CO
      step coloc_mps 250 python scripts/bench_serve_http.py $CO --mps --append ;;
    formats)
      step formats 250 python scripts/bench_serve_http.py --clients 256 --format mp3,pcm --seconds 15 $C \
        --out "$R/r" --stem serve_http_formats_24khz
      step formats_w8 200 python scripts/bench_serve_http.py --clients 256 --format mp3 --seconds 15 $C --workers 8 \
        --out "$R/r" --stem serve_http_formats_24khz --append ;;
    first) step first 500 python scripts/bench_serve_http.py --clients 1,64,256 --arrivals poisson,burst --seconds 3 \
             --pace 1 --repeat 3 --format pcm $C --out "$R/r" --stem serve_http_first_audio_24khz
           # 8 workers: at 256 streams a worker's loop, 64 streams' chunks and LM events, holds the HTTP part
           step first_w8 150 python scripts/bench_serve_http.py --clients 256 --arrivals poisson,burst --seconds 3 --pace 1 \
             --format pcm $C --workers 8 --out "$R/r" --stem serve_http_first_audio_24khz --append ;;
    first256)  # time to first audio at 256 Poisson clients, pcm, three rounds: the LM request's way split
      # into send and accept (Server-Timing's lm_send / lm_sent_at)
      step first256 300 python scripts/bench_serve_http.py --clients 256 --arrivals poisson --seconds 3 --pace 1 \
        --repeat 3 --format pcm $C --out "$R/r" --stem serve_http_first_audio_256 ;;
    text)
      step textws 300 python scripts/bench_serve_http.py --clients 256 --text-ws 5 --sentence-every 3 --seconds 20 $C \
        --arrivals stagger,poisson \
        --out "$R/r" --stem serve_http_long_text_24khz
      step long3x 300 python scripts/bench_serve_http.py --clients 256 --arrivals poisson --input-chars 1000 --pace 3 \
        --seconds 60 $C --out "$R/r" --stem serve_http_long_text_24khz --append ;;
    soak_start)
      mkdir -p /tmp/soak
      setsid nohup python scripts/soak_serve.py --clients 256 --minutes 10 --disconnect 0.1 --lm-faults 0.05,0.02,0.01 $C \
        --out /tmp/soak --stem soak_serve_24khz > /tmp/soak/log 2>&1 < /dev/null &
      echo "soak started: soak_collect within 30 minutes of the machine's start" ;;
    soak_collect)
      for _ in $(seq 560); do [ -f /tmp/soak/soak_serve_24khz.json ] && break; sleep 1; done
      cp /tmp/soak/soak_serve_24khz.* /tmp/soak/log "$R/r/" 2>/dev/null || echo "the soak has not finished" ;;
    corpora) step corpora 560 python scripts/bench_dataset_notebook.py --files 3000 --out "$R/r" \
               --stem dataset_orpheus_24khz ;;
    cpu16) step cpu16 420 python scripts/bench_cpu.py --threads 1 --streams 1,16 --procs 16 --rounds 2 --forms layered,compiled \
             --out "$R/r" --stem cpu_stream_24khz_16core ;;
    serve16)
      # the workers' share of the cores: 16 of one thread each (SO_REUSEPORT's hash leaves the busiest
      # with twice the mean), of two threads each (a busy worker may take a second core), 8 of two,
      # and 4 feeding one engine process that batches every stream on the cores' threads
      for variant in "16 1" "16 2" "8 2" "4 0"; do
        set -- $variant
        step "serve16_w$1_t$2" 125 python scripts/bench_serve_http.py --device cpu --workers "$1" --cpu-threads "$2" \
          $([ "$2" = 0 ] && echo --shared-engine) --clients 32,48,64 --seconds 20 --max-batch 64 --max-streams 128 \
          --client-procs 2 --out "$R/r" --stem serve_cpu_24khz_16core $([ "$1" = 16 ] && [ "$2" = 1 ] || echo --append)
      done ;;
    ab)  # the formats' and the text WebSockets' loads on an older package (AB_TREE, carried) and this one,
      # both measured by this tree's bench script
      : "${AB_TREE:?set AB_TREE to an older package: bash scripts/ab_tree.sh REV makes .ab/REV}"
      # new_asyncio: this tree without uvloop (a module of that name that fails to import comes first on
      # the path, so uvicorn and the clients fall back to asyncio's loop, as in the runs before it was carried)
      mkdir -p /tmp/no_uvloop/uvloop && echo "raise ImportError('uvloop hidden for an A/B')" > /tmp/no_uvloop/uvloop/__init__.py
      for k in ${AB_KEYS:-old new old2 new2 textws_old textws_new new_asyncio}; do
        dir=$(cd "${AB_NEW:-.}" && pwd); case $k in *old*) dir=$(cd "$AB_TREE" && pwd) ;; esac
        load="--format mp3,pcm --seconds 15"; case $k in textws*) load="--text-ws 5 --sentence-every 3 --seconds 20" ;; esac
        path="/tmp/site:$dir"; case $k in *asyncio) path="/tmp/no_uvloop:$path" ;; esac
        step "ab_$k" 110 env PYTHONPATH="$path" python scripts/bench_serve_http.py --clients 256 \
          $load $C --out "$R/r" --stem "serve_http_ab_$k"
      done ;;
    trim)  # serve's memory trim against none, on one host: mp3 and pcm at 256 streams, on / off / on
      for k in on off on2; do
        step "trim_$k" 110 python scripts/bench_serve_http.py --clients 256 --format mp3,pcm --seconds 15 $C \
          $([ $k = off ] && echo --memory-trim 0) --out "$R/r" --stem "serve_http_trim_$k"
      done ;;
    levers)  # serve's GPU-memory levers, one process each: the README recipe by phase (profile_memory.py)
      # with none, each alone and both (with_levers.py; the lease of bf108f2 ran a third, Triton-only transposed convs, dropped)
      for v in none outside expandable both; do
        flags=""; alloc="-u PYTORCH_CUDA_ALLOC_CONF"
        case $v in outside|both) flags="--buffers-outside-pool" ;; esac
        case $v in expandable|both) alloc="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" ;; esac
        step "levers_$v" 150 env $alloc python scripts/with_levers.py $flags \
          scripts/profile_memory.py --out "$R/r" --stem "levers_$v"
      done ;;
    slices)  # the README recipe by phase with the step's stages on slices of rows (--rows-per-pass) and whole,
      # a fresh process each, interleaved; SLICE_KEYS: the rows per pass in order (0: whole steps)
      i=0
      for rows in ${SLICE_KEYS:-0 128 64 0 128 64}; do
        i=$((i + 1))
        step "slices_${rows}_$i" 150 python scripts/profile_memory.py --rows-per-pass "$rows" --out "$R/r" \
          --stem "slices_${rows}_$i"
      done ;;
    compress)  # what declining the WebSockets' compression does to the text WebSockets' load, on one host
      for k in accept decline accept2 decline2; do
        step "compress_$k" 110 python scripts/bench_serve_http.py --clients 256 --text-ws 5 --sentence-every 3 \
          --seconds 20 $C $(case $k in accept*) echo --ws-compression ;; esac) --out "$R/r" --stem "serve_http_compress_$k"
      done ;;
    *) echo "unknown section $section (see the head of this script)"; pack; exit 2 ;;
  esac
done
pack
