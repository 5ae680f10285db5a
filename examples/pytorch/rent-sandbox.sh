#!/usr/bin/env bash
# A recover.command for `relaunch watch` that anyone can run on this machine (Linux, root): it
# rents a replacement the way a provider's CLI rents a GPU, here a local sandbox instance
# (`relaunch sandbox create`), and prints its HOST and host key fingerprint on the last line.
# Every name goes into rented.txt first, so nothing is left behind unseen; destroy them with
#   xargs -n1 relaunch sandbox destroy < rented.txt
# RELAUNCH_INDEX: the package index the instance serves itself (default: the one `relaunch demo`
# builds); RELAUNCH_SANDBOX_KEY: the public key it accepts (default: relaunch's sandbox key);
# RELAUNCH_SANDBOX_ADDRESS: the address it gets (default: the next free one), as a provider
# gives an address it took back from an instance destroyed.
set -euo pipefail
name="rent$(date +%s%N | tail -c 8)"             # sandbox names: at most 12 characters
echo "$name" >> rented.txt
echo "renting $name for $RELAUNCH_NAME (attempt $RELAUNCH_ATTEMPT; lost: $RELAUNCH_LOST_HOST)" >&2
relaunch sandbox create "$name" --index "${RELAUNCH_INDEX:-$HOME/.cache/relaunch/index}" \
    ${RELAUNCH_SANDBOX_KEY:+--key "$RELAUNCH_SANDBOX_KEY"} ${RELAUNCH_SANDBOX_ADDRESS:+--address "$RELAUNCH_SANDBOX_ADDRESS"} \
    --json > "$name.json"
python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print(d["host"], d["host_key_fingerprint"])' \
    "$name.json"
