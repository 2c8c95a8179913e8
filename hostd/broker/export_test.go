package broker

import "time"

// SetStretchResumeWait sets how long a RESUME across vsock stretches
// waits (stretchResumeWait) and returns what puts it back.
func SetStretchResumeWait(d time.Duration) (restore func()) {
	old := stretchResumeWait
	stretchResumeWait = d
	return func() { stretchResumeWait = old }
}
