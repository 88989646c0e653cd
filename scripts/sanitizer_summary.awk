# Count compute-sanitizer reports by the call that made them and the device function they name.
#   compute-sanitizer --tool racecheck --print-limit 0 --show-backtrace no \
#     python3 scripts/every_kernel.py --backend cuda --each | awk -f scripts/sanitizer_summary.awk
# Prints the tool's summary lines, then "count  call | report | function" per kind of report
# (a call is every_kernel.py's "call: kernel case dtype" line that preceded the report).
/^call: / { call = substr($0, 7); next }
/^========= [A-Z]/ && !/SUMMARY|COMPUTE-SANITIZER|Target application|Saved host/ {
    kind = $0; sub(/^========= /, "", kind); sub(/ at .*/, "", kind)
    if (kind ~ /^Error: Race/) {  # racecheck names the function on the report's own line
        f = $0; sub(/.* at /, "", f); sub(/\+0x.*/, "", f); sub(/ in .*/, "", f)
        n[call " | " kind " | " substr(f, 1, 160)]++
        want = 0
    } else want = 1
    next
}
want && /^=========     at / {
    f = $0; sub(/^=========     at /, "", f); sub(/\+0x.*/, "", f); sub(/\(.*/, "", f)
    n[call " | " kind " | " substr(f, 1, 160)]++
    want = 0; next
}
/SUMMARY|Traceback|BackendError|calls of/ { print }
END { for (k in n) printf "%7d  %s\n", n[k], k }
