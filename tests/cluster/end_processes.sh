# Sourced by the cluster scripts, which run as PID 1 of a fresh PID namespace: every other
# process there was started by the script (Ray's head, raylets, agents, workers, sshd).
# end_processes: SIGTERM each of them by PID, wait for all to end (30 s), SIGKILL what is
# left and wait again, so nothing still writes into a directory the script removes next.

_live_pids() {  # PIDs of this namespace but PID 1 and this shell; zombies have ended
  local p pid line rest
  for p in /proc/[0-9]*; do
    pid=${p#/proc/}
    { [ "$pid" = 1 ] || [ "$pid" = "$BASHPID" ]; } && continue
    read -r line < "$p/stat" 2>/dev/null || continue  # ended meanwhile
    rest=${line##*) }  # after "(comm) ", which may hold spaces
    [ "${rest%% *}" = Z ] || echo "$pid"
  done
}

end_processes() {
  local sig pids i
  for sig in TERM KILL; do
    pids=$(_live_pids)
    [ -z "$pids" ] && return 0
    # shellcheck disable=SC2086
    kill -s "$sig" $pids 2>/dev/null || true
    for ((i = 0; i < 60; i++)); do
      sleep 0.5
      [ -z "$(_live_pids)" ] && return 0
    done
  done
  echo "processes still alive after SIGKILL: $(_live_pids)" >&2
  return 1
}
