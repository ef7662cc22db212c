DROP TABLE saga_participant_steps;
DROP TABLE saga_operator_actions;
DROP TABLE saga_history;
DROP TABLE saga_instances;
