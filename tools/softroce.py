"""Run a command where a Soft-RoCE (rxe) device exists.

    python tools/softroce.py [options] -- COMMAND [ARGS...]
    python tools/softroce.py --host -- COMMAND      # real machine whose kernel has rdma_rxe
    python tools/softroce.py --guests 2 -- CMD_ON_FIRST ::: CMD_ON_SECOND

Guest mode (default) boots Debian's kernel under QEMU with software emulation
(TCG: this machine's KVM cannot run stock kernels), shares the host's `/`
read-only over virtio-9p with a writable tmpfs overlay on top, loads rdma_rxe,
creates rxe0 on a dummy netdev (192.0.2.1/24, documentation range; the guest has
no NIC, nothing leaves it), then runs COMMAND in the same working directory
with the same environment (so the same venv), streams its output and exits
with its exit code. It powers the guest off afterwards; `--timeout` bounds the
whole run. Host mode only creates rxe0 on a dummy netdev and runs COMMAND.

Two guests (--guests 2) are joined by a virtual Ethernet link: QEMU's stream
netdev over a unix socket between the two QEMU processes (lossless, in order,
MTU 9000; no host networking). Each has rxe0 on its virtio NIC, 192.0.2.1 and
192.0.2.2, and runs its own command with FABRIC_GUEST_ADDR (its address) and
FABRIC_PEER_ADDR set (and FABRIC_WIRE_DEV, its NIC); output lines carry [1]
or [2]. The exit code is the first failing command's (0 if both pass); once
one command has failed, the other guest is stopped after 30 s. A command that
creates the file $FABRIC_WIRE_KILL_PEER has the other guest's QEMU killed at
once (a host that vanishes; that guest then counts as passed).

Needs (installed by tools/setup.sh unless FABRIC_SOFTROCE=0): qemu-system-x86, linux-image-amd64,
busybox-static, rdma-core, ibverbs-utils. Facts and timings: ../shared/FACTS.md.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import io
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

GUEST_IP = "192.0.2.1/24"
# rxe takes its path MTU from the netdev: 1500 -> 1024-byte packets, 9000 -> 4096.
MODULES_EARLY = ["virtio_pci", "9pnet_virtio", "9p", "overlay"]
RDMA_MODULES = ["rdma_rxe", "ib_uverbs", "rdma_ucm"]


class HarnessError(Exception):
    """The harness itself could not run (missing package, no kernel, ...)."""


def newest_kernel() -> tuple[str, str]:
    kernels = sorted(glob.glob("/boot/vmlinuz-*"))
    for path in reversed(kernels):
        kver = path.split("vmlinuz-", 1)[1]
        if os.path.exists(f"/lib/modules/{kver}/kernel/drivers/infiniband/sw/rxe"):
            return path, kver
    raise HarnessError("no kernel with rdma_rxe in /boot and /lib/modules "
                       "(apt-get install linux-image-amd64)")


def module_paths(kver: str, names: list[str]) -> list[str]:
    """The .ko files for names, dependencies first, each once."""
    out: list[str] = []
    for name in names:
        r = subprocess.run(["modprobe", "-S", kver, "--show-depends", name],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise HarnessError(f"modprobe cannot resolve {name} for {kver}: {r.stderr.strip()}")
        for line in r.stdout.splitlines():
            parts = line.split()
            if parts and parts[0] == "insmod" and parts[1] not in out:
                out.append(parts[1])
    return out


def cpio_newc(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A newc cpio archive of (name, mode, data) entries."""
    buf = io.BytesIO()
    ino = 1
    for name, mode, data in entries + [("TRAILER!!!", 0, b"")]:
        nb = name.encode() + b"\0"
        hdr = "070701" + "".join(f"{v:08x}" for v in (
            ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0))
        buf.write(hdr.encode() + nb)
        buf.write(b"\0" * ((4 - (110 + len(nb)) % 4) % 4))
        buf.write(data)
        buf.write(b"\0" * ((4 - len(data) % 4) % 4))
        ino += 1
    return buf.getvalue()


INIT = r"""#!/bin/busybox sh
# Stage 1 (initramfs): mount the host's / read-only over 9p with a tmpfs
# overlay, then hand over to stage 2 inside it.
/bin/busybox mkdir -p /proc /sys /dev /lower /rw /newroot
/bin/busybox mount -t proc proc /proc
/bin/busybox mount -t sysfs sys /sys
/bin/busybox mount -t devtmpfs dev /dev
for m in $(cat /modules); do /bin/busybox insmod "$m" || echo "insmod $m failed"; done
/bin/busybox mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=262144 hostroot /lower || exec /bin/busybox sh -c 'echo "stage1: cannot mount the host root"; echo o > /proc/sysrq-trigger'
/bin/busybox mount -t tmpfs -o size=1g tmpfs /rw
/bin/busybox mkdir -p /rw/upper /rw/work
/bin/busybox mount -t overlay overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot
/bin/busybox mkdir -p /newroot/run/fabric-job
/bin/busybox mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 job /newroot/run/fabric-job
/bin/busybox umount /proc /sys /dev 2>/dev/null
exec /bin/busybox switch_root /newroot /bin/sh /run/fabric-job/stage2.sh
"""

STAGE2 = r"""#!/bin/sh
# Stage 2 (the host's filesystem, overlaid): rxe0, then the command.
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /dev/shm
# (no tmpfs on /tmp: the working directory may live there; the overlay is writable)
J=/run/fabric-job
finish() { echo "$1" > $J/exit; sync; echo o > /proc/sysrq-trigger; sleep 30; }
for m in {rdma_modules}; do modprobe "$m" || { echo "softroce: modprobe $m failed" >> $J/output; finish 97; }; done
ip link set lo up
{net_setup}
rdma link add rxe0 type rxe netdev $NETDEV || { echo "softroce: rdma link add failed" >> $J/output; finish 97; }
i=0
while [ "$(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)" != "4: ACTIVE" ]; do
    i=$((i+1)); [ $i -gt 200 ] && { echo "softroce: rxe0 never became ACTIVE" >> $J/output; finish 97; }
    sleep 0.05
done
echo "softroce: rxe0 ACTIVE on $NETDEV ($(uname -r))" >> $J/output
. $J/env.sh
export FABRIC_IN_SOFTROCE_GUEST=1
cd {cwd} || finish 98
{command} >> $J/output 2>&1
finish $?
"""


def build_initramfs(kver: str, cache_dir: str) -> str:
    path = os.path.join(cache_dir, f"initramfs-{kver}.cpio.gz")
    if os.path.exists(path):
        return path
    busybox = shutil.which("busybox") or "/bin/busybox"
    with open(busybox, "rb") as f:
        bb = f.read()
    if b"GLIBC" in bb[:4096] and not os.path.exists("/usr/share/doc/busybox-static"):
        raise HarnessError("busybox must be static (apt-get install busybox-static)")
    entries = [("bin", 0o40755, b""), ("bin/busybox", 0o100755, bb), ("init", 0o100755, INIT.encode())]
    mods = module_paths(kver, MODULES_EARLY)
    names = []
    entries.append(("lib", 0o40755, b""))
    for i, m in enumerate(mods):
        name = f"lib/{i:02d}-{os.path.basename(m)}"
        with open(m, "rb") as f:
            data = f.read()
        if m.endswith(".xz") or m.endswith(".zst"):
            raise HarnessError(f"compressed module {m}: not supported")
        entries.append((name, 0o100644, data))
        names.append("/" + name)
    entries.append(("modules", 0o100644, "\n".join(names).encode() + b"\n"))
    os.makedirs(cache_dir, exist_ok=True)
    tmp = path + ".tmp"
    with gzip.open(tmp, "wb", compresslevel=1) as f:
        f.write(cpio_newc(entries))
    os.replace(tmp, path)
    return path


# How stage 2 makes the netdev under rxe0 ($NETDEV). One guest: a dummy
# netdev (rxe talks to itself). Two guests: the virtio NIC on the wire, found
# by the MAC address QEMU gave it.
DUMMY_NET = """NETDEV=sr0
ip link add sr0 type dummy && ip link set sr0 mtu {mtu} && ip addr add {guest_ip} dev sr0 && ip link set sr0 up || finish 97"""
WIRE_NET = """modprobe virtio_net || { echo "softroce: modprobe virtio_net failed" >> $J/output; finish 97; }
NETDEV=""
for d in /sys/class/net/*; do [ "$(cat $d/address)" = "{mac}" ] && NETDEV=$(basename $d); done
[ -n "$NETDEV" ] || { echo "softroce: no NIC with MAC {mac}" >> $J/output; finish 97; }
ip link set $NETDEV mtu {mtu} && ip addr add {guest_ip} dev $NETDEV && ip link set $NETDEV up || finish 97
export FABRIC_WIRE_DEV=$NETDEV FABRIC_WIRE_KILL_PEER=$J/kill-peer"""
WIRE_ADDRS = ("192.0.2.1", "192.0.2.2")


class Guest:
    """One QEMU guest running one command; its output is relayed as it comes."""

    def __init__(self, command: list[str], memory: int, cpus: int, mtu: int,
                 net_setup: str = DUMMY_NET, nic: tuple[str, ...] = ("-nic", "none"),
                 guest_ip: str = GUEST_IP, env: dict[str, str] | None = None, label: str = ""):
        qemu = shutil.which("qemu-system-x86_64")
        if qemu is None:
            raise HarnessError("qemu-system-x86_64 is missing (apt-get install qemu-system-x86)")
        kernel, kver = newest_kernel()
        cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "fabric", "softroce")
        initrd = build_initramfs(kver, cache)
        self.label = label
        self.job = tempfile.mkdtemp(prefix="softroce-")
        env_lines = []
        for k, v in {**os.environ, **(env or {})}.items():
            if k.isidentifier() and not k.startswith(("BASH_FUNC",)) and k not in ("PWD", "OLDPWD", "SHLVL", "_"):
                env_lines.append(f"export {k}={shlex.quote(v)}")
        with open(os.path.join(self.job, "env.sh"), "w") as f:
            f.write("\n".join(env_lines) + "\n")
        with open(os.path.join(self.job, "stage2.sh"), "w") as f:
            f.write(STAGE2.replace("{net_setup}", net_setup)
                    .replace("{rdma_modules}", " ".join(RDMA_MODULES))
                    .replace("{guest_ip}", guest_ip)
                    .replace("{mtu}", str(mtu))
                    .replace("{cwd}", shlex.quote(os.getcwd()))
                    .replace("{command}", " ".join(shlex.quote(c) for c in command)))
        self.out_path = os.path.join(self.job, "output")
        self.exit_path = os.path.join(self.job, "exit")
        self.serial = os.path.join(self.job, "serial.log")
        open(self.out_path, "w").close()
        # -cpu max: the default qemu64 model lacks SSE4.2 and friends, which
        # numpy (x86-64-v2 baseline) needs; TCG emulates them.
        cmd = [qemu, "-accel", "tcg,thread=multi", "-cpu", "max", "-smp", str(cpus), "-m", str(memory),
               "-kernel", kernel, "-initrd", initrd,
               "-append", "console=ttyS0 panic=-1 rdinit=/init loglevel=4",
               "-display", "none", "-serial", f"file:{self.serial}", "-monitor", "none",
               "-no-reboot", *nic,
               "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
               "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot",
               "-fsdev", f"local,id=job,path={self.job},security_model=none,multidevs=remap",
               "-device", "virtio-9p-pci,fsdev=job,mount_tag=job"]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        self.pos = 0
        self.line_start = True
        self.code: int | None = None
        self.peer_killed = False

    def relay(self) -> None:
        """Copy what the command printed since the last call to stdout."""
        with open(self.out_path, "rb") as f:
            f.seek(self.pos)
            chunk = f.read()
        if not chunk:
            return
        self.pos += len(chunk)
        if self.label:
            # a label opens every line, not every chunk (a chunk may end mid-line)
            lines = chunk.splitlines(keepends=True)
            chunk = b"".join((self.label.encode() if i or self.line_start else b"") + line
                             for i, line in enumerate(lines))
            self.line_start = chunk.endswith(b"\n")
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()

    def exit_code(self) -> int | None:
        if os.path.exists(self.exit_path):
            text = open(self.exit_path).read().strip()
            if text:
                return int(text)
        return None

    def running(self) -> bool:
        self.relay()
        if self.code is None:
            self.code = self.exit_code()
        return self.proc.poll() is None

    def stop(self, code: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.code = code

    def finish(self, verbose: bool) -> int:
        """The command's exit code (99: the guest stopped without one); removes the job."""
        try:
            self.relay()
            if self.code is None:
                self.code = self.exit_code()
            if self.code is None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                tail = open(self.serial, errors="replace").read()[-3000:] if os.path.exists(self.serial) else ""
                print(f"softroce: {self.label}the guest stopped without an exit code.\nqemu: {err}\nserial:\n{tail}",
                      file=sys.stderr)
                return 99
            if verbose:
                print(f"softroce: {self.label}guest done in {time.monotonic() - self.started:.1f} s, exit {self.code}",
                      file=sys.stderr)
            return self.code
        finally:
            shutil.rmtree(self.job, ignore_errors=True)


def kill_on_request(guests: list[Guest]) -> None:
    """A command that writes $FABRIC_WIRE_KILL_PEER has the other guest's
    QEMU killed (SIGKILL): a host that vanishes without a word, for the tests
    of what its peers then see. The killed guest counts as passed."""
    for g in guests:
        if len(guests) > 1 and not g.peer_killed and os.path.exists(os.path.join(g.job, "kill-peer")):
            g.peer_killed = True
            for other in guests:
                if other is not g and other.proc.poll() is None:
                    other.proc.kill()
                    other.proc.wait()
                    other.code = 0
                    print(f"softroce: {other.label}killed (SIGKILL to its QEMU), as {g.label.strip()} asked",
                          file=sys.stderr)


FAILED_PEER_GRACE = 30.0      # seconds a guest may run on once the other's command failed


def watch(guests: list[Guest], timeout: float, verbose: bool) -> list[int]:
    """Relay the guests' output until all have stopped (or the timeout stops
    them). Once one guest's command failed, the others get FAILED_PEER_GRACE
    seconds: a server whose client died would otherwise wait for the timeout."""
    started = time.monotonic()
    try:
        while any([g.running() for g in guests]):
            kill_on_request(guests)
            failed = [g for g in guests if g.code not in (None, 0)]
            if len(guests) > 1 and failed:
                grace_end = time.monotonic() - started + FAILED_PEER_GRACE
                if grace_end < timeout:
                    timeout = grace_end
                    print(f"softroce: {failed[0].label}failed; the other guest has {FAILED_PEER_GRACE:.0f} s",
                          file=sys.stderr)
            if time.monotonic() - started > timeout:
                print(f"softroce: timed out after {timeout:.0f} s; stopping the guest"
                      + ("s" if len(guests) > 1 else ""), file=sys.stderr)
                for g in guests:
                    if g.proc.poll() is None:
                        g.stop(124)
                break
            time.sleep(0.2)
    finally:
        for g in guests:
            if g.proc.poll() is None:
                g.stop(124)
    return [g.finish(verbose) for g in guests]


def run_guest(command: list[str], timeout: float, memory: int, cpus: int, verbose: bool,
              mtu: int = 9000) -> int:
    return watch([Guest(command, memory, cpus, mtu)], timeout, verbose)[0]


def run_wire(commands: list[list[str]], timeout: float, memory: int, cpus: int, verbose: bool,
             mtu: int = 9000) -> int:
    """Two guests joined by a virtual Ethernet link (QEMU's stream netdev over
    a unix socket: lossless, in order), each with rxe0 on its NIC, addresses
    192.0.2.1 and 192.0.2.2; each command sees FABRIC_GUEST_ADDR and
    FABRIC_PEER_ADDR. Non-zero if either command fails."""
    wire_dir = tempfile.mkdtemp(prefix="softroce-wire-")
    sock = os.path.join(wire_dir, "wire.sock")
    guests: list[Guest] = []
    try:
        for i, command in enumerate(commands):
            mac = f"52:54:00:00:02:{i + 1:02x}"
            mine, peer = WIRE_ADDRS[i], WIRE_ADDRS[1 - i]
            side = "server=on" if i == 0 else "server=off"
            nic = ("-netdev", f"stream,id=wire,{side},addr.type=unix,addr.path={sock}",
                   "-device", f"virtio-net-pci,netdev=wire,mac={mac}")
            guests.append(Guest(command, memory, cpus, mtu, WIRE_NET.replace("{mac}", mac), nic,
                                f"{mine}/24", {"FABRIC_GUEST_ADDR": mine, "FABRIC_PEER_ADDR": peer},
                                label=f"[{i + 1}] "))
            if i == 0:
                deadline = time.monotonic() + 30       # the second guest connects to the first's socket
                while not os.path.exists(sock):
                    if guests[0].proc.poll() is not None or time.monotonic() > deadline:
                        raise HarnessError("the first guest never opened the wire's socket")
                    time.sleep(0.05)
        codes = watch(guests, timeout, verbose)
        guests = []
        # a command's own failure says more than the stop (124) it caused in the other guest
        return next((c for c in codes if c not in (0, 124)), next((c for c in codes if c), 0))
    finally:
        for g in guests:
            g.stop(124)
            g.finish(verbose)
        shutil.rmtree(wire_dir, ignore_errors=True)


def run_host(command: list[str], timeout: float) -> int:
    """On a machine whose kernel has rdma_rxe: rxe0 on a dummy netdev, then the command."""
    if not os.path.exists("/sys/module/rdma_rxe") and subprocess.run(["modprobe", "rdma_rxe"]).returncode != 0:
        raise HarnessError("this kernel has no rdma_rxe module; use guest mode (the default)")
    subprocess.run(["modprobe", "ib_uverbs"])
    if not os.path.exists("/sys/class/infiniband/rxe0"):
        subprocess.run(["ip", "link", "add", "sr0", "type", "dummy"], check=False)
        subprocess.run(["ip", "addr", "add", GUEST_IP, "dev", "sr0"], check=False)
        subprocess.run(["ip", "link", "set", "sr0", "up"], check=True)
        subprocess.run(["rdma", "link", "add", "rxe0", "type", "rxe", "netdev", "sr0"], check=True)
    return subprocess.run(command, timeout=timeout).returncode


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", action="store_true", help="set up rxe on this machine instead of a guest")
    ap.add_argument("--timeout", type=float, default=900, help="seconds for the whole run (default 900)")
    ap.add_argument("--memory", type=int, default=2048, help="guest memory in MiB")
    ap.add_argument("--cpus", type=int, default=2)
    ap.add_argument("--mtu", type=int, default=9000,
                    help="MTU of the dummy netdev under rxe0 (9000 gives rxe a 4096-byte path MTU)")
    ap.add_argument("--guests", type=int, default=1, choices=(1, 2),
                    help="2: two guests on a virtual wire; the command is CMD_ON_FIRST ::: CMD_ON_SECOND")
    ap.add_argument("--check", action="store_true", help="only say whether the harness can run here")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("command", nargs="*")
    args = ap.parse_args(argv)
    try:
        if args.check:
            if args.host:
                ok = os.path.exists("/sys/module/rdma_rxe")
                print("host rdma_rxe: " + ("yes" if ok else "no"))
                return 0 if ok else 1
            newest_kernel()
            if shutil.which("qemu-system-x86_64") is None:
                raise HarnessError("qemu-system-x86_64 is missing (apt-get install qemu-system-x86)")
            print("softroce guest: ready")
            return 0
        if not args.command:
            ap.error("give a command after --")
        if args.host:
            return run_host(args.command, args.timeout)
        if args.guests == 2:
            if args.command.count(":::") != 1:
                ap.error("with --guests 2 give CMD_ON_FIRST ::: CMD_ON_SECOND")
            cut = args.command.index(":::")
            first, second = args.command[:cut], args.command[cut + 1:]
            if not first or not second:
                ap.error("with --guests 2 give CMD_ON_FIRST ::: CMD_ON_SECOND")
            return run_wire([first, second], args.timeout, args.memory, args.cpus, args.verbose, args.mtu)
        return run_guest(args.command, args.timeout, args.memory, args.cpus, args.verbose, args.mtu)
    except HarnessError as e:
        print(f"softroce: {e}", file=sys.stderr)
        return 96


if __name__ == "__main__":
    sys.exit(main())
