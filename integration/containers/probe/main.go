// Command probe is what the container tests run inside a container to see
// what hostd answers on the control socket: it connects to $SHUNT_CONTROL,
// sends HELLO, and prints "WELCOME <guest id>" or "ERROR <reason> <text>"
// (exit 0), or what went wrong (exit 1).
package main

import (
	"fmt"
	"net"
	"os"
	"time"

	"github.com/shuntnet/shunt/internal/proto"
	"github.com/shuntnet/shunt/shm/ring"
)

func main() {
	c, err := net.DialTimeout("unix", os.Getenv("SHUNT_CONTROL"), 5*time.Second)
	if err != nil {
		fmt.Println("DIAL", err)
		os.Exit(1)
	}
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	// A refused process may find its HELLO's write failing (hostd wrote
	// ERROR and closed at once): the ERROR is there to read all the same.
	werr := proto.Write(c, &proto.Msg{Type: proto.Hello, PID: uint32(os.Getpid()), Formats: 1 << ring.FormatVersion})
	m, _, err := proto.Read(c, nil)
	switch {
	case err != nil && werr != nil:
		fmt.Println("WRITE", werr, "READ", err)
		os.Exit(1)
	case err != nil:
		fmt.Println("READ", err)
		os.Exit(1)
	case m.Type == proto.Welcome:
		fmt.Println("WELCOME", m.GuestID)
	case m.Type == proto.Error:
		fmt.Println("ERROR", m.Reason, m.Text)
	default:
		fmt.Println("OTHER", m.Type)
	}
}
