set -u
W=/tmp/on; rm -rf $W; mkdir -p $W
cp kernels/gemv_fused.py $W/new.py
row() { python3 -m inspector bench --model v4-shape --tg 128 --pp 128 --batch 1 --reps 3 --gpu-weights --format md \
        --json-out "$W/$1.json" > "$W/$1.log" 2>&1; echo "$1: $(grep -E '^\| tg128' $W/$1.log | cut -d'|' -f3,9)"; }
for round in 1 2 3; do
  cp bench/_old_gemv_fused.py kernels/gemv_fused.py; row old_$round
  cp $W/new.py kernels/gemv_fused.py; row new_$round
done
cp $W/new.py kernels/gemv_fused.py
tar -czf $OUT/oldnew.tar.gz -C $W .
