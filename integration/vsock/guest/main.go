//go:build linux

// Command guest is the program TestVhostUserVsock runs inside its VM: it
// loads the guest's vsock modules, then runs each phase named on its
// command line and prints one SHUNT-VSOCK line per phase.
//
//	connect:PORT:BYTES:SEED   connect to the host (CID 2) on PORT, send
//	                          BYTES seeded bytes while reading until EOF
//	listen:PORT:BYTES:SEED    accept one host connection on PORT, the same
//	parallel:PORT:BYTES:SEED  four connects to PORT at once (seeds SEED+i)
//	vstream:PORT:BYTES:0      BenchmarkVsockVM: send BYTES zeros to the host
//	                          over vsock, then wait for its close
//	vpong:PORT:COUNT:0        echo COUNT 8-byte messages over vsock
//	tstream, tpong            the same over TCP to 10.0.0.1 (virtio-net)
//	target:ADDR:0:0           the address gdial connects to
//	pause:MS:0:0              sleep MS milliseconds (the VM reboots when
//	                          the program ends: its kernel's last packets
//	                          would be lost with it)
//	gdial:PORT:BYTES:SEED     TestVsockProcessGuest: connect to ADDR:PORT
//	                          with guestlib (the VM's control port, no
//	                          ivshmem: the flow goes over vsock), wait for
//	                          the fast path, then as connect
//	gflip:PORT:0:SEED         TestVsockPolicyFlips: as gdial, then send
//	                          seeded bytes (paced) until the host's
//	                          stream ends, and give per-path counts
//	glisten:PORT:BYTES:SEED   TestVsockVMToVM: listen on PORT with guestlib,
//	                          accept one connection, wait for the fast
//	                          path, then as gdial (BYTES 0: paced seeded
//	                          bytes until the host connects to PORT+1)
//	bserve:PORT:ROUNDS:0      BenchmarkVsockVMToVM: serve ROUNDS rounds of
//	                          bclient's connections, Shunt on PORT, TCP
//	                          on PORT+1
//	bclient:PORT:ROUNDS:MIB   BenchmarkVsockVMToVM: ROUNDS interleaved
//	                          rounds against ADDR (Shunt, then TCP):
//	                          setup, 8 B ping-pong, a MIB MiB stream
//	gkill:PORT:0:SEED         TestVsockKilled: run gchild (as gflip's
//	                          start, then write seeded bytes for ever)
//	                          in a process of its own, SIGKILL it after
//	                          2 MiB
//	stretch:R.S.G:BYTES:SEED  TestVsockStretch: open the vsock stretch of
//	                          flow region R slot S gen G (guestlib/vstretch),
//	                          write BYTES seeded bytes into its write ring
//	                          from offset SEED*1000 and leave, while reading
//	                          its read ring to the other writer's leave
//	cdir:DIR:0:0              where TestVsockPreload put the C side's files
//	vstretchd:0:0:0           start DIR/shunt-vstretchd (the C library's
//	                          stretches) and wait for its socket
//	cedge:PORT:BYTES:SEED     shunt-edge client ADDR PORT stream under
//	                          shunt-run (SHUNT_VSOCK=1): BYTES seeded bytes
//	                          each way, checked byte for byte at both ends
//	cedgeflip:PORT:BYTES:SEED as cedge, paced (SHUNT_EDGE_PACE_US): the
//	                          test flips its path meanwhile
//	cedgectl:PORT:BYTES:SEED  TestVsockPreloadControl: as cedgeflip, with
//	                          no SHUNT_VSOCK and as uid 65534 (the VM has
//	                          no control port: the library takes its
//	                          channel over vsock, and stretches with it)
//	cnginx:PORT:BYTES:SEED    TestVsockPreloadControl: nginx under
//	                          shunt-run -v (workers as nobody) serving
//	                          /blob (BYTES of SEED's stream) on PORT, in
//	                          the background; once it listens, the next
//	ciperf:PORT:SECS:REV      iperf3 -c ADDR -p PORT -t SECS under shunt-run
//	                          (SHUNT_VSOCK=1), with -R if REV is 1
//	ciperfd:PORT:0:0          iperf3 -s -p PORT under shunt-run, in the
//	                          background; once it listens, the next phase
//	mpiexec:PORT:0:0          TestVsockMPI: run the shell command each TCP
//	                          connection to PORT sends (mpirun's rsh
//	                          agent), SHUNT_VSOCK=1, until the VM stops
//
// Each line gives the SHA-256 of what was sent and of what was received,
// and how many bytes arrived.
package main

import (
	"crypto/sha256"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	for _, m := range os.Args[1:] {
		if strings.HasPrefix(m, "/") {
			if err := insmod(m); err != nil {
				fmt.Printf("SHUNT-VSOCK ERROR insmod %s: %v\n", m, err)
				os.Exit(1)
			}
			continue
		}
		f := strings.Split(m, ":")
		if len(f) != 4 {
			fmt.Printf("SHUNT-VSOCK ERROR phase %q\n", m)
			os.Exit(1)
		}
		port, _ := strconv.ParseUint(f[1], 10, 32)
		n, _ := strconv.ParseInt(f[2], 10, 64)
		seed, _ := strconv.ParseUint(f[3], 10, 64)
		var err error
		switch f[0] {
		case "target":
			target = f[1]
		case "pause":
			time.Sleep(time.Duration(port) * time.Millisecond) // the VM lives on a while (it reboots once the program ends)
		case "gdial":
			err = gdial(uint32(port), n, seed)
		case "gflip":
			err = gflip(uint32(port), seed)
		case "glisten":
			err = glisten(uint32(port), n, seed)
		case "bserve":
			err = bserve(uint32(port), n)
		case "bclient":
			err = bclient(uint32(port), n, int64(seed)<<20)
		case "gkill":
			err = gkill(uint32(port), seed)
		case "gchild":
			err = gchild(uint32(port), seed)
		case "stretch":
			err = stretch(f[1], n, seed)
		case "cdir":
			cdir = f[1]
		case "vstretchd":
			err = startVstretchd()
		case "cedge":
			err = cedge("cedge", uint32(port), n, seed, 0)
		case "cedgeflip":
			err = cedge("cedgeflip", uint32(port), n, seed, edgePace)
		case "cedgectl":
			err = cedgeAs("cedgectl", nobody, nil, uint32(port), n, seed, edgePace)
		case "cnginx":
			err = cnginx(uint32(port), n, seed)
		case "ciperf":
			err = ciperf(uint32(port), n, seed != 0)
		case "ciperfd":
			err = ciperfd(uint32(port))
		case "mpiexec":
			err = mpiexec(uint32(port))
		default:
			err = phase(f[0], uint32(port), n, seed)
		}
		if err != nil {
			fmt.Printf("SHUNT-VSOCK ERROR %s: %v\n", m, err)
			os.Exit(1)
		}
	}
}

func insmod(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.FinitModule(int(f.Fd()), "", 0); err != nil && err != unix.EEXIST {
		return err
	}
	return nil
}

func phase(mode string, port uint32, n int64, seed uint64) error {
	var fd int
	var err error
	switch mode {
	case "vstream", "vpong", "tstream", "tpong":
		return bench(mode, port, n)
	case "parallel":
		errs := make(chan error, parallel)
		for i := range parallel {
			go func() { errs <- phase("connect", port, n, seed+uint64(i)) }()
		}
		for range parallel {
			if err := <-errs; err != nil {
				return err
			}
		}
		return nil
	case "connect":
		fd, err = connect(port)
	case "listen":
		fd, err = accept(port)
	default:
		return fmt.Errorf("mode %q", mode)
	}
	if err != nil {
		return err
	}
	conn := os.NewFile(uintptr(fd), "vsock")
	defer conn.Close()
	start := time.Now()
	sent := make(chan []byte, 1)
	go func() {
		h := sha256.New()
		src := io.LimitReader(rand.NewChaCha8(seedBytes(seed)), n)
		_, err := io.Copy(io.MultiWriter(conn, h), src)
		if err != nil {
			fmt.Printf("SHUNT-VSOCK ERROR write: %v\n", err)
		}
		unix.Shutdown(fd, unix.SHUT_WR)
		sent <- h.Sum(nil)
	}()
	h := sha256.New()
	got, err := io.Copy(h, conn)
	if err != nil {
		return fmt.Errorf("read after %d bytes: %w", got, err)
	}
	lport := uint32(0)
	if sa, err := unix.Getsockname(fd); err == nil {
		lport = sa.(*unix.SockaddrVM).Port
	}
	fmt.Printf("SHUNT-VSOCK %s port=%d lport=%d sent=%x recv=%x bytes=%d ms=%d\n", mode, port, lport, <-sent, h.Sum(nil), got, time.Since(start).Milliseconds())
	return nil
}

// parallel is how many connections the parallel phase opens at once.
const parallel = 4

func seedBytes(seed uint64) (b [32]byte) {
	for i := range b {
		b[i] = byte(seed >> (8 * (i % 8)))
	}
	return b
}

// connect retries for 20 s: the device may still be probing.
func connect(port uint32) (int, error) {
	deadline := time.Now().Add(20 * time.Second)
	for {
		fd, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return -1, err
		}
		err = unix.Connect(fd, &unix.SockaddrVM{CID: unix.VMADDR_CID_HOST, Port: port})
		if err == nil {
			return fd, nil
		}
		unix.Close(fd)
		if time.Now().After(deadline) {
			return -1, fmt.Errorf("connect to 2:%d: %w", port, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func accept(port uint32) (int, error) {
	l, err := unix.Socket(unix.AF_VSOCK, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	defer unix.Close(l)
	if err := unix.Bind(l, &unix.SockaddrVM{CID: unix.VMADDR_CID_ANY, Port: port}); err != nil {
		return -1, err
	}
	if err := unix.Listen(l, 4); err != nil {
		return -1, err
	}
	fmt.Printf("SHUNT-VSOCK LISTENING port=%d\n", port)
	fd, _, err := unix.Accept(l)
	return fd, err
}

// bench is the guest's end of BenchmarkVsockVM: no hashing, so the
// figures are the transport's.
func bench(mode string, port uint32, n int64) error {
	var c io.ReadWriteCloser
	var shut func() error
	if mode[0] == 'v' {
		fd, err := connect(port)
		if err != nil {
			return err
		}
		c, shut = os.NewFile(uintptr(fd), "vsock"), func() error { return unix.Shutdown(fd, unix.SHUT_WR) }
	} else {
		var tc *net.TCPConn
		for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(200 * time.Millisecond) {
			d, err := net.Dial("tcp", fmt.Sprintf("10.0.0.1:%d", port))
			if err == nil {
				tc = d.(*net.TCPConn)
				break
			}
			if time.Now().After(deadline) {
				return err
			}
		}
		c, shut = tc, tc.CloseWrite
	}
	defer c.Close()
	start := time.Now()
	if strings.HasSuffix(mode, "stream") {
		buf := make([]byte, 64<<10)
		for left := n; left > 0; {
			k, err := c.Write(buf[:min(int64(len(buf)), left)])
			if err != nil {
				return err
			}
			left -= int64(k)
		}
		if err := shut(); err != nil {
			return err
		}
		if _, err := io.Copy(io.Discard, c); err != nil {
			return err
		}
	} else {
		msg := make([]byte, 8)
		for i := int64(0); i < n; i++ {
			if _, err := io.ReadFull(c, msg); err != nil {
				return fmt.Errorf("pong %d: %w", i, err)
			}
			if _, err := c.Write(msg); err != nil {
				return err
			}
		}
	}
	fmt.Printf("SHUNT-VSOCK %s port=%d n=%d ms=%d\n", mode, port, n, time.Since(start).Milliseconds())
	return nil
}
