# Shell helpers the bench scripts source.
# max A B: the larger of two numbers (benches keep each side's best round).
max() { awk -v a="$1" -v b="$2" 'BEGIN { print (a > b ? a : b) }'; }
