package integration

import (
	"context"
	"fmt"
	"os"

	"github.com/shuntnet/shunt/guestlib"
)

// child is a guest process started by a test (inside a guest namespace):
// SHUNT_E2E_CHILD=writer dials SHUNT_E2E_ADDR through SHUNT_CONTROL and
// writes until it is killed.
func child() int {
	switch os.Getenv("SHUNT_E2E_CHILD") {
	case "writer":
		c, err := guestlib.DialContext(context.Background(), "tcp4", os.Getenv("SHUNT_E2E_ADDR"))
		if err != nil {
			fmt.Fprintln(os.Stderr, "dial:", err)
			return 1
		}
		fmt.Println(c.Path())
		buf := make([]byte, 64<<10)
		for {
			if _, err := c.Write(buf); err != nil {
				fmt.Fprintln(os.Stderr, "write:", err)
				return 1
			}
		}
	}
	return 2
}
